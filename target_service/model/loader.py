"""Build the target model from a Hugging Face checkpoint directory (bf16/fp16/fp32 or 4-bit).

Tensors the text model does not use (vision tower, MTP head) are never read.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from dflash_serve.checkpoint.module_loading import load_module_weights
from dflash_serve.checkpoint.resolve import resolve_model_dir
from dflash_serve.checkpoint.safetensors_reader import TensorReader
from dflash_serve.checkpoint.target_embeddings import read_head
from dflash_serve.layers.rotary import RotaryEmbedding
from dflash_serve.qwen35_config import load_qwen35_config
from target_service.model.decoder import Qwen35TextModel

logger = logging.getLogger(__name__)

# GDN decay parameters stay fp32 whatever the compute dtype (as the reference does).
FP32_PARAMETERS = ("A_log", "dt_bias")


def load_target_model(
    path_or_id: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    show_progress: bool = False,
) -> Qwen35TextModel:
    """Load a Qwen3.5 text model; errors name the file or tensor at fault."""
    model_dir = resolve_model_dir(path_or_id)
    config = load_qwen35_config(model_dir)
    reader = TensorReader(model_dir)
    with torch.device("meta"):
        model = Qwen35TextModel(config)
    load_module_weights(
        model,
        reader,
        config.tensor_prefix,
        dtype,
        device,
        config.quantization,
        FP32_PARAMETERS,
        show_progress,
    )
    if not config.tie_word_embeddings:
        head = nn.Module()
        head.weight = nn.Parameter(read_head(reader, config).to(device, dtype), requires_grad=False)
        model.lm_head = head
    model.rotary = RotaryEmbedding(config.rotary_dim, config.rope_theta).to(device)
    logger.info("loaded %s: %d layers, %s", model_dir, config.num_hidden_layers, dtype)
    return model.eval()
