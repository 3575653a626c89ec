"""When the services take the GPU fast path, and what a failure to start it tells the user."""

from __future__ import annotations

import pytest

from dflash_serve.errors import ConfigError, InvalidRequestError
from dflash_serve.kernels import fast_path_startup
from dflash_serve.service_settings import ServiceSettings


def test_fast_path_is_for_gpus_unless_turned_off():
    assert not ServiceSettings(device="cpu").uses_gpu_fast_path()
    assert not ServiceSettings(device="cuda", gpu_fast_path=False).uses_gpu_fast_path()
    assert ServiceSettings(device="cuda:1").uses_gpu_fast_path()  # triton is a test dependency


def test_a_failed_start_names_the_way_out():
    with (
        pytest.raises(ConfigError, match="--no-gpu-fast-path") as caught,
        fast_path_startup(is_enabled=True),
    ):
        raise RuntimeError("PTX compile failed")
    assert "PTX compile failed" in str(caught.value)
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_other_failures_pass_through_unchanged():
    with pytest.raises(RuntimeError, match="disk"), fast_path_startup(is_enabled=False):
        raise RuntimeError("disk full")
    with pytest.raises(InvalidRequestError), fast_path_startup(is_enabled=True):
        raise InvalidRequestError("bad tap layer")
