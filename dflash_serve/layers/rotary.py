"""Rotary position embedding (NeoX rotate-half), optionally on the first dims of a head only.

Qwen3.5 rotates 64 of 256 dims (partial_rotary_factor 0.25); the DFlash drafter rotates all.
Positions are absolute token indices, so cached keys never need re-rotation.
"""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Cos/sin tables for the first `rotary_dim` dims of a head at given absolute positions."""

    def __init__(self, rotary_dim: int, theta: float) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: int64 [...]; returns fp32 cos, sin of shape [..., rotary_dim]."""
        freqs = positions.float()[..., None] * self.inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] dims of x [..., tokens, heads, head_dim] (NeoX half split).

    cos/sin: [..., tokens, rotary_dim] from `RotaryEmbedding.cos_sin`.
    """
    rotary_dim = cos.shape[-1]
    cos = cos.unsqueeze(-2).to(x.dtype)
    sin = sin.unsqueeze(-2).to(x.dtype)
    rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotate_half = torch.cat((-rotated[..., half:], rotated[..., :half]), dim=-1)
    return torch.cat((rotated * cos + rotate_half * sin, passed), dim=-1)
