"""The embedded default model pair: what `dflash-serve up` serves when no model is named.

Until a trained demo pair ships in the repository, this is a tiny Qwen3.5-architecture
target and a DFlash drafter with random weights and a byte-level tokenizer, made
deterministically (fixed seeds) on first run and cached. It exercises the whole product
offline on any machine; its text is gibberish and its drafts are rarely accepted.
"""

from __future__ import annotations

import logging
from pathlib import Path

from dflash_serve.checkpoint.byte_tokenizer import special_token_ids, write_byte_tokenizer
from dflash_serve.checkpoint.synthetic import (
    small_drafter_config,
    small_target_config,
    write_drafter,
    write_target,
)

logger = logging.getLogger(__name__)

EMBEDDED_VERSION = "random-v2"
COMPLETE_MARKER = "COMPLETE"
VOCAB_SIZE = 272  # 256 bytes + 6 special tokens, padded


def embedded_target_config() -> dict:
    ids = special_token_ids()
    eos = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    return small_target_config(VOCAB_SIZE, eos, max_position_embeddings=4096)


def embedded_drafter_config() -> dict:
    return small_drafter_config(VOCAB_SIZE, special_token_ids()["<|mask|>"], sliding_window=256)


def embedded_model_pair(cache_root: Path) -> tuple[Path, Path]:
    """(target_dir, drafter_dir) under cache_root, written on first use."""
    root = cache_root / f"embedded-{EMBEDDED_VERSION}"
    target_dir, drafter_dir = root / "target", root / "drafter"
    if (root / COMPLETE_MARKER).is_file():
        return target_dir, drafter_dir
    logger.info("writing the embedded default model pair to %s (first run)", root)
    write_target(target_dir, embedded_target_config(), "bf16", seed=20261129)
    write_byte_tokenizer(target_dir)
    write_drafter(drafter_dir, embedded_drafter_config(), seed=20261130)
    (root / COMPLETE_MARKER).write_text(EMBEDDED_VERSION)
    return target_dir, drafter_dir
