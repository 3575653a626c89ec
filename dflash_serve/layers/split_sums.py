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
    """partials: fp32 [splits, rows, N], split s summed over its slice of K (contiguous, or
    a column slice of wider partials: `columns`); `shape`: the result's shape ([..., N], rows
    = its leading dims' product). The result is bf16(partials[0] + partials[1] + … in split
    order)."""

    partials: torch.Tensor
    shape: tuple[int, ...]
    dtype = torch.bfloat16  # the result's

    @property
    def num_splits(self) -> int:
        return self.partials.shape[0]

    @property
    def split_stride(self) -> int:
        return self.partials.stride(0)

    # What argument checks read of an input: the result's shape and dtype; the device and the
    # strides of the split view that a kernel indexes.
    @property
    def device(self) -> torch.device:
        return self.partials.device

    def stride(self, dim: int | None = None):
        return self.split_view().stride(dim) if dim is not None else self.split_view().stride()

    def reshape(self, *shape: int) -> SplitSums:
        """The same partial sums standing for the result viewed in another shape (-1 allowed;
        the split view must exist without a copy)."""
        reshaped = SplitSums(self.partials, tuple(self.split_view().reshape(shape).shape))
        try:
            reshaped.split_view()
        except RuntimeError as error:
            raise ValueError(
                f"shape: partial sums {self.shape} with split strides {self.stride()} have no "
                f"view as {shape} (a copy would drop the other splits)"
            ) from error
        return reshaped

    def columns(self, start: int, stop: int) -> SplitSums:
        """The result's columns start..stop, as partial sums (views, no copy)."""
        return SplitSums(self.partials[..., start:stop], (*self.shape[:-1], stop - start))

    def split_view(self) -> torch.Tensor:
        """Split 0 viewed in the result's shape: the pointer and row strides a kernel indexes,
        with `split_stride` between splits (fp32; never copies)."""
        return self.partials[0].view(self.shape)

    def total(self) -> torch.Tensor:
        """The bf16 result in plain torch: the same fp32 additions in the same order and the
        same rounding as the kernels that sum splits, so bit for bit theirs (a fallback: on
        the kernel path the residual add sums them)."""
        summed = self.partials[0].clone()  # (a column slice: contiguous from here on)
        for partial in self.partials[1:]:
            summed += partial
        return summed.to(torch.bfloat16).reshape(self.shape)


def materialized(x: torch.Tensor | SplitSums) -> torch.Tensor:
    """x itself, or the bf16 result its partial sums stand for."""
    return x.total() if isinstance(x, SplitSums) else x


def kernel_operand(x: torch.Tensor | SplitSums) -> tuple[torch.Tensor, int, int]:
    """(what a kernel indexes, the stride between splits, the number of splits; 0 for a plain
    tensor): the one way kernels take an input that may be left as partial sums."""
    if isinstance(x, SplitSums):
        return x.split_view(), x.split_stride, x.num_splits
    return x, 0, 0
