"""Which dtype each service loads its model in, for every --dtype and device."""

from __future__ import annotations

import pytest
import torch

from dflash_serve import service_settings
from dflash_serve.service_settings import ServiceSettings
from drafter_service.config import DrafterServiceConfig
from drafter_service.runtime import DrafterRuntime


@pytest.mark.parametrize("is_native", [True, False])
def test_auto_runs_the_drafter_in_bf16_only_on_a_cpu_with_native_bf16(monkeypatch, is_native):
    monkeypatch.setattr(service_settings, "cpu_multiplies_bf16_natively", lambda: is_native)
    cpu = ServiceSettings(device="cpu")
    assert cpu.resolved_dtype == "float32"  # the target's: exact decoding on the CPU
    assert cpu.drafter_dtype == ("bfloat16" if is_native else "float32")
    assert ServiceSettings(device="cuda").drafter_dtype == "bfloat16"
    for chosen in ("float32", "float16", "bfloat16"):  # an explicit --dtype is kept
        assert ServiceSettings(device="cpu", dtype=chosen).drafter_dtype == chosen


@pytest.mark.parametrize("is_native", [True, False])
def test_drafter_runtime_loads_in_the_drafter_dtype(
    monkeypatch, dflash_dir, causal_lm_dir, is_native
):
    monkeypatch.setattr(service_settings, "cpu_multiplies_bf16_natively", lambda: is_native)
    runtime = DrafterRuntime(DrafterServiceConfig(str(dflash_dir), str(causal_lm_dir)))
    try:
        want = torch.bfloat16 if is_native else torch.float32
        assert runtime.engine.model.fc.weight.dtype == want
        assert runtime.engine.model.embed_weight.dtype == want
        assert runtime.engine.cache.keys.dtype == want
    finally:
        runtime.close()
