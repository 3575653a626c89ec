"""The benchmark's checkpoint writer produces real layouts: transformers and our loaders agree."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3_5ForCausalLM

from dflash_serve.checkpoint.synthetic import (
    small_drafter_config,
    small_target_config,
    write_drafter,
    write_target,
)
from drafter_service.model.loader import load_drafter
from target_service.engine import TargetEngine
from target_service.model.loader import load_target_model
from target_service.model.state import StateShape

SMALL_TARGET = small_target_config(256, 255)
SMALL_DRAFTER = small_drafter_config(256, 250, sliding_window=8)
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def prefill_logits(path):
    engine = TargetEngine(load_target_model(path), StateShape(1, 32))
    return engine.prefill(engine.open_sequence(), PROMPT).last_logits


def test_bf16_layout_matches_transformers(tmp_path):
    path = write_target(tmp_path / "t", SMALL_TARGET, "bf16", seed=1)
    oracle = Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = oracle(torch.tensor([PROMPT])).logits[0, -1]
    torch.testing.assert_close(prefill_logits(path), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("layout", ["int4_mlp", "int4_all"])
def test_int4_layouts_load_with_the_expected_modules_quantized(tmp_path, layout):
    path = write_target(tmp_path / layout, SMALL_TARGET, layout, seed=1)
    model = load_target_model(path)
    int4 = {n for n, m in model.named_modules() if type(m).__name__ == "Int4Linear"}
    mlp = {n for n in int4 if ".mlp." in n}
    assert len(mlp) == 3 * 4
    assert (int4 == mlp) == (layout == "int4_mlp")
    assert torch.isfinite(prefill_logits(path)).all()


def test_drafter_layout_loads_against_the_target(tmp_path):
    target = write_target(tmp_path / "t", SMALL_TARGET, "bf16", seed=1)
    drafter = load_drafter(write_drafter(tmp_path / "d", SMALL_DRAFTER, seed=2), target)
    assert drafter.config.target_layer_ids == (1, 3)
    assert drafter.fc.weight.shape == (128, 256)
