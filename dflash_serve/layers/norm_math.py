"""The RMSNorm arithmetic of the plain-torch path, as functions of tensors.

The norm modules (`norms.py`) compute with these; the Triton norm kernels are tested against
them, so the kernels and the modules agree on everything but the order of the row's sum.
"""

from __future__ import annotations

import torch

from dflash_serve.layers.activations import silu


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x · rsqrt(mean(x²) + eps) in fp32; returns fp32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool) -> torch.Tensor:
    """x̂ · (1 + w) (zero-centred, Qwen3.5) or x̂ · w, in fp32, rounded once to x's dtype."""
    scale = weight.float()
    if zero_centred:
        scale = 1.0 + scale
    return (rms_normalize(x, eps) * scale).to(x.dtype)


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """(w · x̂ in x's dtype) ⊙ silu(gate), the output norm of a Gated DeltaNet layer."""
    normed = rms_normalize(x, eps).to(x.dtype)
    out = weight * normed
    return (out.float() * silu(gate.float())).to(x.dtype)
