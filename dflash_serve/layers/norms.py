"""RMSNorm variants of the Qwen3.5 family, computed in fp32.

Qwen3.5's block norms are zero-centred (`x̂ · (1 + w)`); the DFlash drafter and the gated
norm inside GDN layers use the weight as is (`x̂ · w`). Keeping the offset an explicit
constructor argument makes the checkpoint mapping a plain name copy.

torch's GPU reductions may split a row's sum differently for different row counts; after
`use_row_kernel()` the norms run as Triton kernels with one fixed reduction order per row.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_serve.layers import norm_math
from dflash_serve.layers.rotary import apply_rotary
from dflash_serve.layers.split_sums import SplitSums, materialized


class RMSNorm(nn.Module):
    """RMSNorm over the last dim; `zero_centred` selects `1 + w` (Qwen3.5) or `w` (Qwen3)."""

    def __init__(self, dim: int, eps: float, zero_centred: bool) -> None:
        super().__init__()
        self.eps = eps
        self.zero_centred = zero_centred
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centred else torch.ones(dim))
        self.kernel = None
        self.add_kernel = None

    def use_row_kernel(self) -> None:
        from dflash_serve.kernels.rms_norm import add_rms_norm, rms_norm

        self.kernel = rms_norm
        self.add_kernel = add_rms_norm

    def shares_settings(self, other: RMSNorm) -> bool:
        """Same eps and kind (`w` or `1 + w`), so that one kernel launch can apply both (the
        fused q/k norms of `attention_inputs_into_cache` take one of each)."""
        return (self.eps, self.zero_centred) == (other.eps, other.zero_centred)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x.contiguous(), self.weight, self.eps, self.zero_centred)
        return norm_math.rms_norm(x, self.weight, self.eps, self.zero_centred)

    def norm_and_rotate(
        self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """`apply_rotary(self(x), *cos_sin)` for x [..., heads, head_dim] (attention's q/k
        norms): one kernel on the kernel path, bit for bit the two steps."""
        if self.kernel is not None:
            from dflash_serve.kernels.norm_rotary import norm_rotary

            return norm_rotary(x, self.weight, self.eps, self.zero_centred, *cos_sin)
        return apply_rotary(self(x), *cos_sin)

    def add_and_norm(
        self, x: torch.Tensor, delta: torch.Tensor | SplitSums
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, norm(x + delta)): a residual add and the norm after it, one kernel on
        the kernel path, bit for bit the two steps (delta's split-K partial sums, if it is
        left as those, summed in the same kernel)."""
        if self.kernel is not None:
            return self.add_kernel(x, delta, self.weight, self.eps, self.zero_centred)
        total = x + materialized(delta)
        return total, self(total)


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm(o) · w ⊙ silu(z), the output norm of a Gated DeltaNet layer."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.kernel = None

    def use_row_kernel(self) -> None:
        from dflash_serve.kernels.rms_norm import gated_rms_norm

        self.kernel = gated_rms_norm

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            # Strided views go in as they are (the kernel takes row strides): the GDN layer's
            # gate z is a column slice of its stacked input projection, and copying it was a
            # launch per layer.
            return self.kernel(x, gate, self.weight, self.eps)
        return norm_math.gated_rms_norm(x, gate, self.weight, self.eps)
