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


def write_causal_lm(path: Path, seed: int = 0, **fields) -> Path:
    """Text-only layout: Qwen3_5ForCausalLM, tensors under `model.`."""
    config = Qwen3_5TextConfig(**tiny_text_fields(**fields))
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
