"""SwiGLU feed-forward block, shared by the Qwen3.5 target and the DFlash drafter."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_serve.layers.activations import silu
from dflash_serve.layers.linear import Linear, RowKernelGroup, stack_dense_weights


class SwiGLU(nn.Module):
    """down_proj(silu(gate_proj(x)) · up_proj(x)); attribute names match checkpoints."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size)
        self.up_proj = Linear(hidden_size, intermediate_size)
        self.down_proj = Linear(intermediate_size, hidden_size)
        self.gate_up: RowKernelGroup | None = None  # these two are set by fuse_row_kernels
        self.silu_mul = None
        self.gate_up_weight: torch.Tensor | None = None  # set by stack_gate_up

    def fuse_row_kernels(self) -> None:
        """gate_proj and up_proj as one kernel matmul and silu·up as one kernel (after the
        linears' `use_row_kernel`; imported here: a GPU dependency)."""
        from dflash_serve.kernels.silu_mul import silu_mul

        self.gate_up = RowKernelGroup([self.gate_proj, self.up_proj])
        self.silu_mul = silu_mul

    def stack_gate_up(self, with_kernel: bool = True) -> None:
        """For every row count: gate_proj and up_proj as one matmul over their stacked weights
        (idempotent), and with_kernel silu·up as one Triton kernel (imported here: a GPU
        dependency). For the drafter, whose drafts need not be row-independent; the dense
        linears become views of the stacked weight (no second copy)."""
        if self.gate_up_weight is None:
            self.gate_up_weight = stack_dense_weights([self.gate_proj, self.up_proj])
        if with_kernel:
            from dflash_serve.kernels.silu_mul import silu_mul

            self.silu_mul = silu_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self._gate_and_up(x)
        activated = silu(gate) * up if self.silu_mul is None else self.silu_mul(gate, up)
        return self.down_proj(activated)

    def _gate_and_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """gate_proj(x) and up_proj(x): through the row kernel where it takes x's rows (not
        the target's prefill), else one matmul over the stacked weight, else the two linears."""
        if self.gate_up is not None and self.gate_up.accepts(x):
            return self.gate_up(x)
        if self.gate_up_weight is not None:
            return F.linear(x, self.gate_up_weight).chunk(2, dim=-1)
        return self.gate_proj(x), self.up_proj(x)
