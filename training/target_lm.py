"""Train-time use of the serving target model: random init from a real checkpoint, LM loss.

The model trained here is the very module the target service serves
(`target_service.model.decoder.Qwen35TextModel`), run in prefill mode over whole rows with a
fresh `TargetState` per batch; nothing about its maths is re-implemented for training.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from dflash_serve.checkpoint.synthetic import write_target
from target_service.model.decoder import Qwen35TextModel
from target_service.model.forward_batch import ForwardBatch
from target_service.model.loader import load_target_model
from target_service.model.state import StateShape, TargetState


def init_target(config: dict, seed: int, device: str) -> Qwen35TextModel:
    """A trainable fp32 model with the synthetic checkpoints' (seeded) random init."""
    with tempfile.TemporaryDirectory(prefix="dflash-init-") as workdir:
        write_target(Path(workdir), config, "bf16", seed=seed)
        model = load_target_model(workdir, torch.float32, device)
    model.train()
    for parameter in model.parameters():
        parameter.requires_grad_(True)
    return model


def forward_rows(
    model: Qwen35TextModel, token_ids: torch.Tensor, tap_layer_ids: tuple[int, ...] = ()
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """token_ids [B, T] from position 0 → (fp32 logits [B, T, vocab], taps or None)."""
    num_rows, num_tokens = token_ids.shape
    state = TargetState(
        model.config,
        StateShape(max_slots=num_rows, max_len=num_tokens),
        model.embed_tokens.weight.dtype,
        token_ids.device,
    )
    batch = ForwardBatch(tuple(range(num_rows)), (0,) * num_rows, num_tokens, is_verify=False)
    hidden, taps = model(token_ids, batch, state, tap_layer_ids)
    return model.logits(hidden), taps


def lm_loss(model: Qwen35TextModel, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; labels [B, T] are the next ids, −100 where ignored."""
    logits, _ = forward_rows(model, inputs)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
