"""Tiny random Qwen3.5 checkpoints written by transformers itself, in both published layouts.

transformers' own classes are the oracle: the tests save them as real checkpoints and load
them with our loader. Weights are re-drawn at a scale that gives well-separated logits, and
norm weights are non-zero so that a `w` vs `1 + w` mistake shows.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5TextConfig,
)

TINY_VOCAB = 160
# Tiny, but with head sizes the kernels tile (powers of two, dots of 16).
KERNEL_FRIENDLY = dict(
    vocab_size=256,
    eos_token_id=255,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
)


def tiny_text_fields(
    layer_types: tuple[str, ...] = (
        "linear_attention",
        "full_attention",
        "linear_attention",
        "linear_attention",
        "full_attention",
    ),
    tie_word_embeddings: bool = True,
) -> dict:
    """A text config with every dimension distinct, so transposition bugs fail loudly."""
    return dict(
        vocab_size=TINY_VOCAB,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=len(layer_types),
        layer_types=list(layer_types),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=12,
        linear_conv_kernel_dim=4,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [1, 1, 0],
        },
        max_position_embeddings=1024,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=TINY_VOCAB - 1,
    )


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Redraw every parameter: matrices ~N(0, 1/√fan_in), vectors small and non-zero."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("A_log"):
                param.copy_(torch.log(torch.rand(param.shape, generator=generator) * 8 + 0.5))
            elif param.ndim >= 2 and "conv1d" not in name:
                param.copy_(noise / param.shape[-1] ** 0.5 * 1.5)
            else:
                param.copy_(noise * 0.3)


def write_causal_lm(path: Path, seed: int = 0, overrides: dict | None = None, **fields) -> Path:
    """Text-only layout: Qwen3_5ForCausalLM, tensors under `model.`; `overrides` replaces
    config fields (sizes) of the tiny defaults."""
    config = Qwen3_5TextConfig(**(tiny_text_fields(**fields) | (overrides or {})))
    model = Qwen3_5ForCausalLM(config)
    randomize_(model, seed)
    model.save_pretrained(path)
    return path


def write_conditional_generation(path: Path, seed: int = 0, **fields) -> Path:
    """VLM layout: nested text_config, tensors under `model.language_model.`, a vision tower."""
    text = tiny_text_fields(**fields)
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=48)
    config = Qwen3_5Config(
        text_config=text, vision_config=vision, tie_word_embeddings=text["tie_word_embeddings"]
    )
    model = Qwen3_5ForConditionalGeneration(config)
    randomize_(model, seed)
    model.save_pretrained(path)
    return path


def load_oracle(path: Path) -> torch.nn.Module:
    """transformers' own model for a checkpoint written above, fp32, eager attention."""
    import json

    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    cls = Qwen3_5ForConditionalGeneration if "Conditional" in arch else Qwen3_5ForCausalLM
    return cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def dflash_config_dict(
    target_layer_ids=(0, 2, 4),
    mask_token_id=TINY_VOCAB - 2,
    layer_types=("sliding_attention", "full_attention"),
    sliding_window=6,
    hidden_size=48,
    is_causal=None,
) -> dict:
    """A z-lab-style drafter config.json (Qwen3 fields plus a dflash_config block)."""
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden_size,
        "intermediate_size": 72,
        "num_hidden_layers": len(layer_types),
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "layer_types": list(layer_types),
        "sliding_window": sliding_window,
        "block_size": 16,
        "vocab_size": TINY_VOCAB,
        "dtype": "bfloat16",
        "dflash_config": {
            "target_layer_ids": list(target_layer_ids),
            "mask_token_id": mask_token_id,
        },
    }
    if is_causal is not None:
        config["is_causal"] = is_causal
    return config


def write_dflash(path: Path, seed: int = 0, **config_fields) -> Path:
    """A random DFlash drafter in z-lab's on-disk format: bf16 safetensors + config.json."""
    import json

    from safetensors.torch import save_file

    config = dflash_config_dict(**config_fields)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    from dflash_serve.checkpoint.synthetic import drafter_tensor_shapes

    for name, shape in drafter_tensor_shapes(config).items():
        noise = torch.randn(shape, generator=generator)
        scaled = noise / shape[-1] ** 0.5 * 1.5 if len(shape) == 2 else 1.0 + 0.3 * noise
        tensors[name] = scaled.to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path
