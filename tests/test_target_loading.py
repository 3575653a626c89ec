"""Loading real on-disk layouts: 4-bit formats, sharding, dtypes, and errors that name the fault."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_serve.checkpoint.int4_formats import (
    PackedInt4Weight,
    awq_quantization_config,
    compressed_tensors_quantization_config,
    pack_awq_gemm,
    pack_compressed_tensors,
)
from dflash_serve.errors import CheckpointError, ConfigError
from dflash_serve.layers.linear import Int4Linear, Linear
from target_service.engine import TargetEngine
from target_service.model.loader import load_target_model
from target_service.model.state import StateShape
from tests.tiny_checkpoints import load_oracle, write_causal_lm

PROMPT = [7, 1, 88, 23, 140, 9, 9, 31]
GROUP = 16
MLP_ONLY = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# Every linear but GDN's in_proj_a/b, whose 4 outputs (tiny model) are below AWQ's 8-column pack.
ALL_WIDE = (
    *MLP_ONLY,
    *("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj"),
)


def last_logits(path) -> torch.Tensor:
    engine = TargetEngine(load_target_model(path), StateShape(max_slots=1, max_len=64))
    slot = engine.open_sequence()
    return engine.prefill(slot, PROMPT).last_logits


def quantize_checkpoint(src, quantized_dir, dequantized_dir, fmt, modules, symmetric=True):
    """Write a 4-bit copy of `src` (only the linears whose names contain one of `modules`)
    and a dense copy holding exactly the dequantized weights, the reference."""
    tensors = load_file(src / "model.safetensors")
    quantized, dequantized = {}, {}
    for name, tensor in tensors.items():
        is_target = name.endswith(".weight") and tensor.ndim == 2 and "embed" not in name
        if not (is_target and any(m in name for m in modules)):
            quantized[name] = dequantized[name] = tensor
            continue
        prefix = name.removesuffix("weight")
        if fmt == "awq":
            packed = pack_awq_gemm(tensor, GROUP)
        else:
            packed = pack_compressed_tensors(tensor, GROUP, symmetric)
        quantized.update({prefix + k: v for k, v in packed.items()})
        weight = PackedInt4Weight(
            "awq_gemm" if fmt == "awq" else "compressed_tensors",
            tensor.shape[0],
            tensor.shape[1],
            GROUP,
            packed,
        )
        dequantized[name] = weight.dequantize(torch.float32)
    dense_config = json.loads((src / "config.json").read_text())
    quantization = (
        awq_quantization_config(GROUP)
        if fmt == "awq"
        else compressed_tensors_quantization_config(GROUP, symmetric)
    )
    quantized_config = {**dense_config, "quantization_config": quantization}
    for out_dir, out_tensors, config in (
        (quantized_dir, quantized, quantized_config),
        (dequantized_dir, dequantized, dense_config),
    ):
        out_dir.mkdir()
        save_file(out_tensors, out_dir / "model.safetensors")
        (out_dir / "config.json").write_text(json.dumps(config))
    return quantized_dir, dequantized_dir


@pytest.mark.parametrize(
    ("fmt", "symmetric", "modules"),
    [
        ("awq", True, MLP_ONLY),
        ("awq", True, ALL_WIDE),
        ("ct", True, ("proj",)),
        ("ct", False, (*MLP_ONLY, "in_proj_qkv", "o_proj")),
    ],
)
def test_int4_checkpoint_matches_dequantized_reference(
    causal_lm_dir, tmp_path, fmt, symmetric, modules
):
    quantized, dequantized = quantize_checkpoint(
        causal_lm_dir, tmp_path / "q", tmp_path / "dq", fmt, modules, symmetric
    )
    model = load_target_model(quantized)
    int4_names = {n for n, m in model.named_modules() if isinstance(m, Int4Linear)}
    linear_names = {n for n, m in model.named_modules() if isinstance(m, Linear | Int4Linear)}
    assert int4_names == {n for n in linear_names if any(m in n for m in modules)}
    assert int4_names
    ours = last_logits(quantized)
    assert torch.equal(ours, last_logits(dequantized))
    with torch.no_grad():
        oracle = load_oracle(dequantized)(torch.tensor([PROMPT])).logits[0, -1]
    torch.testing.assert_close(ours, oracle, atol=1e-4, rtol=1e-4)


def test_sharded_and_half_precision_checkpoints_load(tmp_path):
    from transformers import Qwen3_5ForCausalLM

    dense = write_causal_lm(tmp_path / "dense", seed=5)
    model = Qwen3_5ForCausalLM.from_pretrained(dense)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert torch.equal(last_logits(tmp_path / "sharded"), last_logits(dense))
    for dtype in (torch.bfloat16, torch.float16):
        model.to(dtype).save_pretrained(tmp_path / str(dtype))
        loaded = load_target_model(tmp_path / str(dtype), dtype=dtype)
        assert loaded.layers[0].mlp.up_proj.weight.dtype == dtype
        assert loaded.layers[0].linear_attn.A_log.dtype == torch.float32
        logits = last_logits(tmp_path / str(dtype))
        assert torch.isfinite(logits).all()


def test_vision_tower_is_not_read(conditional_generation_dir, monkeypatch):
    from dflash_serve.checkpoint.safetensors_reader import TensorReader

    read_names = []
    original = TensorReader.read

    def spy(self, name):
        read_names.append(name)
        return original(self, name)

    monkeypatch.setattr(TensorReader, "read", spy)
    load_target_model(conditional_generation_dir)
    assert read_names and all(n.startswith("model.language_model.") for n in read_names)


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_unknown_model_type_is_named(causal_lm_dir, tmp_path):
    path = copy_checkpoint(causal_lm_dir, tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "llama"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="model_type is 'llama'"):
        load_target_model(path)


def test_missing_files_are_named(causal_lm_dir, tmp_path):
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        load_target_model(tmp_path)
    path = copy_checkpoint(causal_lm_dir, tmp_path / "m")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"neither model\.safetensors nor"):
        load_target_model(path)
    with pytest.raises(CheckpointError, match="not a hub id"):
        load_target_model(tmp_path / "does-not-exist")


def test_config_that_disagrees_with_tensors_is_named(causal_lm_dir, tmp_path):
    path = copy_checkpoint(causal_lm_dir, tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 96
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"mlp.gate_proj.weight' has shape \[80, 48\]"):
        load_target_model(path)


def test_missing_and_corrupt_tensors_are_named(causal_lm_dir, tmp_path):
    path = copy_checkpoint(causal_lm_dir, tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(
        CheckpointError, match=r"'model.layers.1.self_attn.k_norm.weight' is missing"
    ):
        load_target_model(path)
    corrupt = copy_checkpoint(causal_lm_dir, tmp_path / "corrupt")
    data = (corrupt / "model.safetensors").read_bytes()
    (corrupt / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load_target_model(corrupt)
