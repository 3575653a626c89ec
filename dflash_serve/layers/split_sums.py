"""A matmul result left as its split-K partial sums, for the kernel that consumes it to add up.

`row_matmul` splits K for small row counts and sums the splits in a second launch. When the
result only feeds the residual add (the mixers' output projections and the MLP's down
projection), `add_rms_norm` sums the splits itself, in the same order and with the same one
rounding to bf16, so the result is bit for bit the same and the sum's launch is saved (64 of
them per verify step of Qwen3.5-4B). Kept free of Triton: the CPU path imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SplitSums:
    """partials: fp32 [splits, rows, N], split s summed over its slice of K; `shape`: the
    result's shape ([..., N], rows = its leading dims' product). The result is
    bf16(partials[0] + partials[1] + … in split order)."""

    partials: torch.Tensor
    shape: tuple[int, ...]

    def total(self) -> torch.Tensor:
        """The bf16 result in plain torch: the same fp32 additions in the same order and the
        same rounding as the kernels that sum splits, so bit for bit theirs (a fallback: on
        the kernel path the residual add sums them)."""
        summed = self.partials[0].clone()
        for partial in self.partials[1:]:
            summed += partial
        return summed.to(torch.bfloat16).reshape(self.shape)


def materialized(x: torch.Tensor | SplitSums) -> torch.Tensor:
    """x itself, or the bf16 result its partial sums stand for."""
    return x.total() if isinstance(x, SplitSums) else x
