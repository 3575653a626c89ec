"""Linear layers (dense or 4-bit) whose per-row result does not depend on the row count.

Speculative output equals target-only output only if a token's result is the same whether it
is computed alone (decode) or inside a 16-token verify block. CPU GEMM kernels pick different
code paths for small row counts (1-3 rows, edge tiles), which changes the low bits; padding
the row count to a multiple of `CPU_ROW_TILE` makes every row go through the same kernel.
A GPU fast path slots in behind `forward` with the same contract.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_serve.checkpoint.int4_formats import PackedInt4Weight

CPU_ROW_TILE = 4


def row_stable_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight.T` for x [..., K], with results per row independent of the number of rows."""
    if x.device.type != "cpu":
        return F.linear(x, weight)
    rows = x.reshape(-1, x.shape[-1])
    num_rows = rows.shape[0]
    padding = -num_rows % CPU_ROW_TILE
    if padding:
        rows = torch.cat((rows, rows.new_zeros(padding, rows.shape[1])))
    out = F.linear(rows, weight)[:num_rows]
    return out.reshape(*x.shape[:-1], weight.shape[0])


class Linear(nn.Module):
    """Bias-free linear layer; `weight` is [out_features, in_features] as in checkpoints."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return row_stable_linear(x, self.weight)


class Int4Linear(nn.Module):
    """A 4-bit linear layer; the packed tensors stay the source of truth.

    The reference path dequantizes once at construction (CPU serving of small models and
    tests); a GPU kernel reading `packed` directly replaces it behind the same forward.
    """

    def __init__(self, packed: PackedInt4Weight, compute_dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features = packed.in_features
        self.out_features = packed.out_features
        self.packed = packed
        self.register_buffer("weight", packed.dequantize(compute_dtype), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return row_stable_linear(x, self.weight)
