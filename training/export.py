"""Write trained models as serving checkpoints: Hugging Face layout (target), z-lab (drafter)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dflash_serve.checkpoint.synthetic import (
    drafter_tensor_shapes,
    stored_dtype,
    target_tensor_shapes,
    write_sharded,
)


def _checked_tensors(module: nn.Module, expected: dict[str, tuple], prefix: str) -> dict:
    """The module's tensors under checkpoint names; fail on any missing or misshapen one."""
    state = {prefix + name: t for name, t in module.state_dict().items()}
    tensors = {}
    for name, shape in expected.items():
        if name not in state:
            raise KeyError(f"trained model has no tensor for checkpoint entry {name}")
        if tuple(state[name].shape) != tuple(shape):
            raise ValueError(f"{name}: trained shape {tuple(state[name].shape)}, expected {shape}")
        tensors[name] = state[name].detach().to("cpu", stored_dtype(name)).contiguous()
    return tensors


def save_target(model: nn.Module, config: dict, out_dir: Path) -> Path:
    """A text-only Qwen3.5 checkpoint (`model.*` names, tied embeddings, bf16)."""
    expected = dict(target_tensor_shapes(config))
    write_sharded(
        out_dir, _checked_tensors(model, expected, "model."), dict(config, dtype="bfloat16")
    )
    return out_dir


def save_drafter(drafter: nn.Module, config: dict, out_dir: Path) -> Path:
    """A DFlash drafter in z-lab's layout (bare names, bf16)."""
    tensors = _checked_tensors(drafter, drafter_tensor_shapes(config), "")
    tensors = {name: t.to(torch.bfloat16) for name, t in tensors.items()}
    write_sharded(out_dir, tensors, dict(config, dtype="bfloat16"))
    return out_dir
