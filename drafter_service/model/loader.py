"""Load a z-lab-format DFlash drafter and attach the target's embeddings and head."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from dflash_serve.checkpoint.module_loading import load_module_weights
from dflash_serve.checkpoint.resolve import resolve_model_dir
from dflash_serve.checkpoint.safetensors_reader import TensorReader
from dflash_serve.checkpoint.target_embeddings import load_target_embeddings
from dflash_serve.layers.rotary import RotaryEmbedding
from drafter_service.model.config import load_dflash_config
from drafter_service.model.dflash import DFlashDrafter

logger = logging.getLogger(__name__)

# Some exports nest the drafter under `model.`; z-lab's own files use bare names.
OPTIONAL_PREFIX = "model."


def load_drafter(
    drafter_path_or_id: str | Path,
    target_path_or_id: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    show_progress: bool = False,
) -> DFlashDrafter:
    """Load the drafter; fail with a clear message if it does not fit the target."""
    drafter_dir = resolve_model_dir(drafter_path_or_id)
    config = load_dflash_config(drafter_dir)
    target = load_target_embeddings(target_path_or_id, dtype, device)
    config.check_fits(target.config)
    reader = TensorReader(drafter_dir)
    prefix = OPTIONAL_PREFIX if reader.has(OPTIONAL_PREFIX + "fc.weight") else ""
    with torch.device("meta"):
        model = DFlashDrafter(config)
    load_module_weights(model, reader, prefix, dtype, device, show_progress=show_progress)
    model.rotary = RotaryEmbedding(config.head_dim, config.rope_theta).to(device)
    model.embed_weight = target.embed_weight
    model.head_weight = target.head_weight
    model.stack_weights()
    logger.info(
        "loaded drafter %s: %d layers, taps %s",
        drafter_dir,
        config.num_hidden_layers,
        list(config.target_layer_ids),
    )
    return model.eval()
