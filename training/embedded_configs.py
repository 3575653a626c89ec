"""Shapes of the embedded default pair: a small Qwen3.5 (GDN + gated attention) and its drafter.

Sized so both checkpoints together stay well under 40 MB in bf16 (about 9 M + 4 M
parameters) while keeping every architectural feature of Qwen3.5-4B: GDN layers with a
causal conv and grouped key heads, gated full attention with partial RoPE, tied embeddings.
The drafter reads three target layers and attends bidirectionally inside its block.
"""

from __future__ import annotations

from dflash_serve.checkpoint.synthetic import DFLASH_4B, QWEN35_4B_TEXT

HIDDEN_SIZE = 320
INTERMEDIATE_SIZE = 960
MAX_POSITIONS = 4096


def embedded_target_config(vocab_size: int, eos_token_ids: list[int]) -> dict:
    """6 layers, (GDN, GDN, attention) × 2, as Qwen3.5's 3:1 pattern shortened."""
    return dict(
        QWEN35_4B_TEXT,
        vocab_size=vocab_size,
        eos_token_id=eos_token_ids,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=6,
        layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        max_position_embeddings=MAX_POSITIONS,
    )


def embedded_drafter_config(vocab_size: int, mask_token_id: int, num_layers: int = 3) -> dict:
    """`num_layers` full-attention layers (1.17 M parameters each beside the shared
    embeddings; the shipped drafter has 6) reading target layers 1, 3 and 5."""
    return dict(
        DFLASH_4B,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        layer_types=["full_attention"] * num_layers,
        sliding_window=None,
        vocab_size=vocab_size,
        dflash_config={"target_layer_ids": [1, 3, 5], "mask_token_id": mask_token_id},
    )
