"""SwiGLU feed-forward block, shared by the Qwen3.5 target and the DFlash drafter."""

from __future__ import annotations

import torch
from torch import nn

from dflash_serve.layers.activations import silu
from dflash_serve.layers.linear import Linear


class SwiGLU(nn.Module):
    """down_proj(silu(gate_proj(x)) · up_proj(x)); attribute names match checkpoints."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size)
        self.up_proj = Linear(hidden_size, intermediate_size)
        self.down_proj = Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu(self.gate_proj(x)) * self.up_proj(x))
