"""Elementwise activations whose result for an element does not depend on the tensor's size.

torch's CPU sigmoid/silu/softplus take a vectorised path for most elements and a scalar path
for a tail whose length depends on the tensor size, and the two differ in the last bit; a
token would then get different results in a 16-token block than alone. exp, log1p and
division are consistent, so the activations are written with those.
"""

from __future__ import annotations

import torch

SOFTPLUS_THRESHOLD = 20.0  # above it softplus(x) == x in fp32, as in torch


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def silu(x: torch.Tensor) -> torch.Tensor:
    return x * sigmoid(x)


def softplus(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x > SOFTPLUS_THRESHOLD, x, torch.log1p(torch.exp(x)))
