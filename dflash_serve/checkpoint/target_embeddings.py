"""The target's token embeddings and output head, which the DFlash drafter borrows.

The drafter has no embedding or head of its own; the drafter service reads just these two
tensors from the target checkpoint (one tensor when they are tied).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_serve.checkpoint.module_loading import read_checked
from dflash_serve.checkpoint.resolve import resolve_model_dir
from dflash_serve.checkpoint.safetensors_reader import TensorReader
from dflash_serve.qwen35_config import Qwen35TextConfig, load_qwen35_config

UNTIED_HEAD_NAME = "lm_head.weight"


@dataclass(frozen=True)
class TargetEmbeddings:
    config: Qwen35TextConfig
    embed_weight: torch.Tensor  # [vocab, hidden]
    head_weight: torch.Tensor  # [vocab, hidden]; the same tensor when tied


def read_head(reader: TensorReader, config: Qwen35TextConfig) -> torch.Tensor:
    """`lm_head.weight` of an untied checkpoint."""
    return read_checked(reader, UNTIED_HEAD_NAME, (config.vocab_size, config.hidden_size))


def load_target_embeddings(
    path_or_id: str | Path, dtype: torch.dtype, device: torch.device | str
) -> TargetEmbeddings:
    model_dir = resolve_model_dir(path_or_id)
    config = load_qwen35_config(model_dir)
    reader = TensorReader(model_dir)
    shape = (config.vocab_size, config.hidden_size)
    embed_name = config.tensor_prefix + "embed_tokens.weight"
    embed = read_checked(reader, embed_name, shape).to(device, dtype)
    head = embed if config.tie_word_embeddings else read_head(reader, config).to(device, dtype)
    return TargetEmbeddings(config, embed, head)
