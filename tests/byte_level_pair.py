"""A tiny random Qwen3.5 target and DFlash drafter with a byte-level tokenizer.

Tests that need to know which ids are which bytes (stop strings that straddle blocks, text
that splits inside a character) use this pair; every id below 256 is one byte.
"""

from __future__ import annotations

from pathlib import Path

from dflash_serve.checkpoint.byte_tokenizer import special_token_ids, write_byte_tokenizer
from dflash_serve.checkpoint.synthetic import (
    small_drafter_config,
    small_target_config,
    write_drafter,
    write_target,
)

VOCAB_SIZE = 272  # 256 bytes + 6 special tokens, padded


def write_byte_level_pair(root: Path) -> tuple[Path, Path]:
    """(target_dir, drafter_dir) under root, random weights from fixed seeds."""
    ids = special_token_ids()
    eos = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    target_config = small_target_config(VOCAB_SIZE, eos, max_position_embeddings=4096)
    drafter_config = small_drafter_config(VOCAB_SIZE, ids["<|mask|>"], sliding_window=256)
    write_target(root / "target", target_config, "bf16", seed=20261129)
    write_byte_tokenizer(root / "target")
    write_drafter(root / "drafter", drafter_config, seed=20261130)
    return root / "target", root / "drafter"
