"""Python's cyclic garbage collector is paused while a CUDA graph is captured.

On the H200, `test_qwen35_4b_shaped_speculative_equals_plain[int4_all-bf16]` failed every time
it ran after the bf16 case in one process ("operation failed due to a previous error during
capture", verify graph (6, 16)): the collector ran in the middle of the capture and freed the
earlier engines' graphs (reference cycles). Pausing it during captures alone made that test
pass; a small synthetic reproduction (tiny graphs dropped, thresholds at 1) did not fail on
the old code, so that GPU test is the regression test, and this one checks the pause itself.
"""

from __future__ import annotations

import gc

import pytest

from dflash_serve.cuda_graphs import _collector_paused


def test_the_collector_is_paused_inside_and_restored_after():
    assert gc.isenabled()
    with _collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with _collector_paused():
            pass
        assert not gc.isenabled()  # a caller's disabled collector stays disabled
    finally:
        gc.enable()


def test_an_exception_inside_restores_the_collector():
    with pytest.raises(RuntimeError), _collector_paused():
        raise RuntimeError("capture failed")
    assert gc.isenabled()
