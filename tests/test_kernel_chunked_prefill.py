"""Prefill's chunked gated delta rule (fla-core on the GPU) against the naive fp32 token loop.

fla-core's kernels sum in a different order and use bf16 tensor-core products, so the check is
closeness with a stated tolerance. On the CPU (fla-core's kernels need a GPU driver) the seam's
own work is checked with a torch stand-in of fla's API: the slots it reads and writes in the
pool, the head mapping, and that other slots stay untouched.
"""

from __future__ import annotations

import logging
import sys

import pytest
import torch

from target_service.kernels.chunked_prefill import (
    chunked_prefill,
    load_chunk_rule,
    warn_token_by_token_prefill,
)
from tests.test_kernel_gated_delta_recurrence import NUM_SLOTS, make_inputs, naive_recurrence


def torch_chunk_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                     use_qk_l2norm_in_kernel, state_v_first):  # fmt: skip
    """fla's `chunk_gated_delta_rule` API over the naive loop (which adds the L2 norm and
    the Dk^-0.5 scale itself)."""
    assert use_qk_l2norm_in_kernel and output_final_state and scale == q.shape[-1] ** -0.5
    assert state_v_first is False
    slots = torch.arange(q.shape[0])
    return naive_recurrence(q, k, v, g, beta, initial_state, slots)


def test_seam_reads_and_writes_only_its_slots():
    q, k, v, g, beta, pool = make_inputs(2, 5, 2, 4, 16, 8, torch.float32, seed=3, device="cpu")
    slots = torch.tensor([3, 1])
    expected_out, expected_states = naive_recurrence(q, k, v, g, beta, pool, slots)
    before = pool.clone()
    out = chunked_prefill(torch_chunk_rule, q, k, v, g, beta, pool, slots)
    assert out.dtype == torch.float32
    assert torch.equal(out, expected_out)
    assert torch.equal(pool[slots], expected_states)
    untouched = [s for s in range(NUM_SLOTS) if s not in (3, 1)]
    assert torch.equal(pool[untouched], before[untouched])


def test_without_fla_core_there_is_no_chunk_rule_and_one_warning(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "fla", None)  # `import fla...` raises ImportError
    monkeypatch.setitem(sys.modules, "fla.ops", None)
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", None)
    warn_token_by_token_prefill.cache_clear()
    with caplog.at_level(logging.WARNING, logger="target_service.kernels.chunked_prefill"):
        assert load_chunk_rule() is None
        assert load_chunk_rule() is None  # a second GDN layer asks again
    warnings = [r.getMessage() for r in caplog.records if "fla-core" in r.getMessage()]
    assert len(warnings) == 1
    assert "token by token" in warnings[0] and "dflash-serve[gpu]" in warnings[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tokens", [1, 100, 700])
def test_fla_chunks_match_the_token_loop_on_qwen35_4b_heads(tokens):
    chunk_rule = load_chunk_rule()
    if chunk_rule is None:
        pytest.skip("fla-core (the gpu extra) is not installed")
    inputs = make_inputs(2, tokens, 16, 32, 128, 128, torch.bfloat16, seed=tokens, device="cuda")
    q, k, v, g, beta, pool = inputs
    pool = torch.randn(NUM_SLOTS, 32, 128, 128, device="cuda") * 0.1
    g = g / 8  # decays of a real model: most of the state survives a token
    slots = torch.tensor([3, 1], device="cuda")
    before = pool.clone()
    out = chunked_prefill(chunk_rule, q, k, v, g, beta, pool, slots)
    cpu = [x.cpu() for x in (q, k, v, g, beta, before)]
    expected_out, expected_states = naive_recurrence(*cpu, slots.cpu())
    assert out.dtype == q.dtype  # as fla computes it
    # bf16 products inside fla's chunks: errors of bf16 size relative to the values.
    torch.testing.assert_close(out.cpu().float(), expected_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(pool[slots].cpu(), expected_states, atol=2e-2, rtol=2e-2)
    assert torch.equal(pool[[0, 2]], before[[0, 2]])
