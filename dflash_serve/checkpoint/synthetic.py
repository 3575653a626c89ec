"""Write Qwen3.5-4B-shaped (or smaller) checkpoints with random weights, in real layouts.

Used by the benchmarks (no real weights can be downloaded here, so speed is measured on
checkpoints of the exact production shapes) and by the embedded default model pair: a
Qwen3.5 text model in Hugging Face layout (bf16; AutoAWQ 4-bit on the MLPs only, like
QuantTrio's build; or on every large linear) and a DFlash drafter in z-lab's layout.
Tensors are drawn on `device` (a GPU makes this fast) and written in shards.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from dflash_serve.checkpoint.int4_formats import awq_quantization_config, pack_awq_gemm

QWEN35_4B_TEXT = {
    "model_type": "qwen3_5_text",
    "architectures": ["Qwen3_5ForCausalLM"],
    "vocab_size": 248320,
    "hidden_size": 2560,
    "intermediate_size": 9216,
    "num_hidden_layers": 32,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],  # repeated below
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    "max_position_embeddings": 262144,
    "tie_word_embeddings": True,
    "eos_token_id": 248046,
    "hidden_act": "silu",
}
QWEN35_4B_TEXT["layer_types"] = QWEN35_4B_TEXT["layer_types"] * 8

DFLASH_4B = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "hidden_size": 2560,
    "intermediate_size": 9216,
    "num_hidden_layers": 6,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1e7,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    "sliding_window": 4096,
    "block_size": 16,
    "vocab_size": 248320,
    "dflash_config": {"target_layer_ids": [1, 5, 9, 13, 17, 21, 25, 29], "mask_token_id": 248077},
}


def small_target_config(vocab_size: int, eos_token_id, **overrides) -> dict:
    """A 4-layer, 128-wide Qwen3.5 (3 GDN + 1 attention): CPU smoke runs, demos, tests."""
    return dict(
        QWEN35_4B_TEXT,
        vocab_size=vocab_size,
        eos_token_id=eos_token_id,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        **overrides,
    )


def small_drafter_config(vocab_size: int, mask_token_id: int, sliding_window: int) -> dict:
    """A 2-layer DFlash drafter reading layers 1 and 3 of `small_target_config`."""
    return dict(
        DFLASH_4B,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=sliding_window,
        vocab_size=vocab_size,
        dflash_config={"target_layer_ids": [1, 3], "mask_token_id": mask_token_id},
    )


LAYOUTS = ("bf16", "int4_mlp", "int4_all")
MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
LARGE_LINEARS = (
    *MLP,
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "linear_attn.in_proj_qkv",
    "linear_attn.in_proj_z",
    "linear_attn.out_proj",
)
AWQ_GROUP = 128
SHARD_BYTES = 2 * 1024**3


def target_tensor_shapes(config: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every text-model tensor, names as in a text-only checkpoint."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv, head_dim = (
        config[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim")
    )
    key_dim = config["linear_num_key_heads"] * config["linear_key_head_dim"]
    value_heads = config["linear_num_value_heads"]
    value_dim = value_heads * config["linear_value_head_dim"]
    conv_dim = 2 * key_dim + value_dim
    yield "model.embed_tokens.weight", (config["vocab_size"], hidden)
    yield "model.norm.weight", (hidden,)
    for i, kind in enumerate(config["layer_types"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (hidden,)
        yield p + "post_attention_layernorm.weight", (hidden,)
        yield p + "mlp.gate_proj.weight", (inter, hidden)
        yield p + "mlp.up_proj.weight", (inter, hidden)
        yield p + "mlp.down_proj.weight", (hidden, inter)
        if kind == "full_attention":
            yield p + "self_attn.q_proj.weight", (2 * heads * head_dim, hidden)
            yield p + "self_attn.k_proj.weight", (kv * head_dim, hidden)
            yield p + "self_attn.v_proj.weight", (kv * head_dim, hidden)
            yield p + "self_attn.o_proj.weight", (hidden, heads * head_dim)
            yield p + "self_attn.q_norm.weight", (head_dim,)
            yield p + "self_attn.k_norm.weight", (head_dim,)
        else:
            a = p + "linear_attn."
            yield a + "in_proj_qkv.weight", (conv_dim, hidden)
            yield a + "in_proj_z.weight", (value_dim, hidden)
            yield a + "in_proj_a.weight", (value_heads, hidden)
            yield a + "in_proj_b.weight", (value_heads, hidden)
            yield a + "conv1d.weight", (conv_dim, 1, config["linear_conv_kernel_dim"])
            yield a + "A_log", (value_heads,)
            yield a + "dt_bias", (value_heads,)
            yield a + "norm.weight", (config["linear_value_head_dim"],)
            yield a + "out_proj.weight", (hidden, value_dim)


def random_tensor(name: str, shape, generator, device) -> torch.Tensor:
    """Values at scales that keep activations finite through 32 layers."""
    if name.endswith("A_log"):
        return torch.log(torch.rand(shape, generator=generator, device=device) * 15 + 1)
    if name.endswith("dt_bias"):
        return torch.rand(shape, generator=generator, device=device)
    noise = torch.randn(shape, generator=generator, device=device)
    if len(shape) == 2:
        return noise / shape[1] ** 0.5
    if "conv1d" in name:
        return noise * 0.5
    if name.endswith("linear_attn.norm.weight"):
        return 1.0 + 0.1 * noise
    return 0.1 * noise  # zero-centred norms: weight near 0 means scale near 1


def stored_dtype(name: str) -> torch.dtype:
    """bf16, except the GDN decay and output-norm parameters, kept fp32 as Qwen3.5 ships them."""
    return torch.float32 if name.endswith(("A_log", "linear_attn.norm.weight")) else torch.bfloat16


def is_quantized(name: str, layout: str) -> bool:
    modules = {"bf16": (), "int4_mlp": MLP, "int4_all": LARGE_LINEARS}[layout]
    return name.endswith(".weight") and any(f".{m}.weight" in name for m in modules)


def write_target(path: Path, config: dict, layout: str, seed: int = 0, device: str = "cpu") -> Path:
    """Write a random Qwen3.5 text checkpoint in the given layout; returns its directory."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    generator = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, shape in target_tensor_shapes(config):
        tensor = random_tensor(name, shape, generator, device)
        if is_quantized(name, layout):
            prefix = name.removesuffix("weight")
            packed = pack_awq_gemm(tensor.float(), AWQ_GROUP)
            tensors.update({prefix + k: v.contiguous() for k, v in packed.items()})
        else:
            tensors[name] = tensor.to(stored_dtype(name))
    full_config = dict(config, dtype="bfloat16")
    if layout != "bf16":
        full_config["quantization_config"] = awq_quantization_config(AWQ_GROUP)
    write_sharded(path, tensors, full_config)
    return path


def drafter_tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Tensor names (z-lab layout, bare) and shapes of a DFlash drafter checkpoint."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv, dim = (config[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim"))
    taps = len(config["dflash_config"]["target_layer_ids"])
    shapes = {
        "fc.weight": (hidden, taps * hidden),
        "hidden_norm.weight": (hidden,),
        "norm.weight": (hidden,),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * dim, hidden),
            p + "self_attn.k_proj.weight": (kv * dim, hidden),
            p + "self_attn.v_proj.weight": (kv * dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * dim),
            p + "self_attn.q_norm.weight": (dim,),
            p + "self_attn.k_norm.weight": (dim,),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        }
    return shapes


def write_drafter(path: Path, config: dict, seed: int = 0, device: str = "cpu") -> Path:
    """Write a random DFlash drafter in z-lab's layout (bf16, bare tensor names)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    shapes = drafter_tensor_shapes(config)
    tensors = {}
    for name, shape in shapes.items():
        noise = torch.randn(shape, generator=generator, device=device)
        value = noise / shape[1] ** 0.5 if len(shape) == 2 else 1.0 + 0.1 * noise
        tensors[name] = value.to(torch.bfloat16)
    write_sharded(path, tensors, dict(config, dtype="bfloat16"))
    return path


def write_sharded(path: Path, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """safetensors shards of at most SHARD_BYTES plus an index (one file when small)."""
    path.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        if size and size + tensor.nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.cpu()
        size += tensor.nbytes
    if len(shards) == 1:
        save_file(shards[0], path / "model.safetensors")
    else:
        weight_map = {}
        for index, shard in enumerate(shards):
            file_name = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, path / file_name)
            weight_map |= dict.fromkeys(shard, file_name)
        index_json = {"metadata": {}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index_json))
    (path / "config.json").write_text(json.dumps(config, indent=2))
