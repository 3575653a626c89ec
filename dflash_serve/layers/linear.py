"""Linear layers (dense or 4-bit) whose per-row result does not depend on the row count.

Speculative output equals target-only output only if a token's result is the same whether it
is computed alone (decode) or inside a 16-token verify block. CPU GEMM kernels pick different
code paths for small row counts (1-3 rows, edge tiles), which changes the low bits; padding
the row count to a multiple of `CPU_ROW_TILE` makes every row go through the same kernel.
On the GPU, cuBLAS picks its algorithm by shape, so after `use_row_kernel(max_rows)` calls of
up to `max_rows` rows (verify and decode) run the Triton `row_matmul` instead, whose launch
configuration depends only on the weight's shape; larger calls (prefill) keep cuBLAS, except
in a forward that asks for more rows (`row_kernels_up_to`: prompts prefilled together).
"""

from __future__ import annotations

import contextvars
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from dflash_serve.checkpoint.int4_formats import PackedInt4Weight
from dflash_serve.layers.int4_reads import INT4_READS
from dflash_serve.layers.split_sums import SplitSums

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


class RowIndependentLinear(nn.Module):
    """What dense and 4-bit layers share: which path a call of a given row count takes."""

    weight: torch.Tensor  # [out_features, in_features] in the compute dtype
    max_kernel_rows = 0
    # On the kernel path, hand on split-K partial sums unsummed (`SplitSums`): set on the
    # layers whose output only feeds the residual add, which sums them (`add_rms_norm`).
    keeps_splits = False

    def use_row_kernel(self, max_rows: int) -> None:
        """Compute calls of at most `max_rows` rows with the row-independent Triton kernel."""
        self.max_kernel_rows = max_rows

    def kernel_weight(self):
        """What `row_matmul` reads: the dense weight."""
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor | SplitSums:
        if fits_row_kernel(x, self.max_kernel_rows):
            return row_kernel_linear(x, self.kernel_weight(), self.keeps_splits)
        return row_stable_linear(x, self.weight)


class Linear(RowIndependentLinear):
    """Bias-free linear layer; `weight` is [out_features, in_features] as in checkpoints."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)


# Rows a forward asks the row kernels to take beyond a layer's own max_kernel_rows.
_ROWS_ASKED = contextvars.ContextVar("row_kernel_rows_asked", default=0)
# Whether 4-bit layers on the kernel path read their bf16 copy whatever `use_row_kernel` chose.
_READING_BF16_COPIES = contextvars.ContextVar("int4_reading_bf16_copies", default=False)


@contextmanager
def reading_bf16_copies(on: bool = True) -> Iterator[None]:
    """Within (if `on`): 4-bit layers on the kernel path read their dequantized bf16 copy
    through the dense `row_matmul`, even where verify and decode read the packed bits. For
    prefill forwards: at prefill's row counts the dense kernel is the faster one (the W4A16
    kernel unpacks every weight again for each row tile), and prefill's bits need only agree
    among prefills (a prompt alone, padded, or sharing a forward), which all run under it."""
    token = _READING_BF16_COPIES.set(on)
    try:
        yield
    finally:
        _READING_BF16_COPIES.reset(token)


@contextmanager
def row_kernels_up_to(rows: int) -> Iterator[None]:
    """Within: where the kernel path is on, calls of up to `rows` rows take the row kernels
    too (a forward of prompts that each alone would take them: see `Qwen35TextModel`)."""
    token = _ROWS_ASKED.set(rows)
    try:
        yield
    finally:
        _ROWS_ASKED.reset(token)


def fits_row_kernel(x: torch.Tensor, max_rows: int) -> bool:
    """Whether x [..., K] has at most `max_rows` rows, or at most the rows a surrounding
    `row_kernels_up_to` asks for (0: the kernel path is off, whatever is asked)."""
    rows = max(max_rows, _ROWS_ASKED.get()) if max_rows > 0 else 0
    return x.numel() <= rows * x.shape[-1]


def row_kernel_matmul(rows: torch.Tensor, weight, keep_splits: bool = False):
    """rows [M, K] @ weightᵀ through the row-independent kernel that reads `weight`: the
    Triton `row_matmul` for a bf16 weight, `w4a16_matmul` for a `PlanarInt4` (imported here:
    GPU dependencies)."""
    from dflash_serve.kernels.w4a16_matmul import PlanarInt4, w4a16_matmul

    if isinstance(weight, PlanarInt4):
        return w4a16_matmul(rows, weight, keep_splits=keep_splits)
    from dflash_serve.kernels.row_matmul import row_matmul

    return row_matmul(rows, weight, keep_splits=keep_splits)


def row_kernel_linear(
    x: torch.Tensor, weight, keep_splits: bool = False
) -> torch.Tensor | SplitSums:
    """x [..., K] through `row_kernel_matmul`; keep_splits: split-K partial sums may be
    handed on unsummed."""
    out = row_kernel_matmul(x.reshape(-1, x.shape[-1]).contiguous(), weight, keep_splits)
    shape = (*x.shape[:-1], out.shape[-1])
    if isinstance(out, SplitSums):
        return SplitSums(out.partials, shape)
    return out.reshape(shape)


class Int4Linear(RowIndependentLinear):
    """A 4-bit linear layer; the packed tensors stay the source of truth.

    The dequantized weight serves the reference path, calls beyond the kernels' rows
    (long prompts) through cuBLAS, and prefill forwards on the row kernels
    (`reading_bf16_copies`). On verify and decode the row kernel reads either that bf16
    weight or, with `use_row_kernel(rows, "int4")`, the 4-bit tensors repacked once for the
    W4A16 kernel (`w4a16_matmul`, 4 bits per weight; see INT4_READS).
    """

    def __init__(self, packed: PackedInt4Weight, compute_dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features = packed.in_features
        self.out_features = packed.out_features
        self.packed = packed
        self.register_buffer("weight", packed.dequantize(compute_dtype), persistent=False)
        self.repacked = None
        self.read_by_group = False  # its repacked copy handed to a RowKernelGroup's stack

    def use_row_kernel(self, max_rows: int, reads: str = INT4_READS[0]) -> None:
        if reads not in INT4_READS:
            raise ValueError(f"reads must be one of {INT4_READS}, got {reads!r}")
        self.repacked = None
        self.read_by_group = False
        if reads == "int4":
            from dflash_serve.kernels.w4a16_matmul import repack_planar

            device = self.weight.device
            on_device = {name: t.to(device) for name, t in self.packed.tensors.items()}
            self.repacked = repack_planar(replace(self.packed, tensors=on_device))
        self.max_kernel_rows = max_rows

    def kernel_weight(self):
        if self.read_by_group:
            raise RuntimeError(
                "this 4-bit layer's weight lives in its RowKernelGroup's stacked matmuls: "
                "call the group (or use_row_kernel again to read it alone)"
            )
        if _READING_BF16_COPIES.get():
            return self.weight
        return self.weight if self.repacked is None else self.repacked

    def hand_repacked_to_group(self) -> None:
        """Free the repacked copy once a RowKernelGroup has stacked it: the group computes
        every call that fits the kernel, packed or (`reading_bf16_copies`) from its stacked
        copies (a call alone would split K by its own shape, with other bits), so the copy
        would only hold memory."""
        self.repacked = None
        self.read_by_group = True


def stack_dense_weights(linears: list[RowIndependentLinear]) -> torch.Tensor:
    """The linears' dense weights stacked along N, for one matmul over all of them; each
    linear's weight becomes a view of its rows (no second copy)."""
    stacked = torch.cat([linear.weight for linear in linears])
    sizes = [linear.out_features for linear in linears]
    for linear, part in zip(linears, stacked.split(sizes), strict=True):
        linear.weight = nn.Parameter(part, requires_grad=False)
    return stacked


class RowKernelGroup:
    """Linears over one input as few `row_matmul` calls: those of one kind (dense, or 4-bit
    of one group size) are computed as one matmul over their weights stacked along N.

    One launch instead of several, and a wider N that keeps the GPU busier. Dense members
    become views of the stacked weight (no second copy; a 4-bit layer reading its bf16 copy
    counts as dense); 4-bit members read packed hand their repacked tensors over
    (`Int4Linear.hand_repacked_to_group`: freed once stacked), and their bf16 copies are
    stacked too, as views, for calls under `reading_bf16_copies` (`copy_calls`: the same
    matmuls over the copies). Every stacked member's bf16 weight becomes a parameter (a
    view). Only the kernel path uses the group: calls above the members' row limit go
    through each linear's bf16 weight as before.
    """

    def __init__(self, linears: list[RowIndependentLinear]) -> None:
        from dflash_serve.kernels.w4a16_matmul import PlanarInt4, concat_planar

        self.linears = linears
        self.max_kernel_rows = min(linear.max_kernel_rows for linear in linears)
        kinds: dict[object, list[int]] = {}
        with reading_bf16_copies(False):  # what verify reads, whatever the caller's context
            kernel_weights = [linear.kernel_weight() for linear in linears]
        for index, weight in enumerate(kernel_weights):
            kind = weight.group_size if isinstance(weight, PlanarInt4) else weight.dtype
            kinds.setdefault(kind, []).append(index)
        self.calls, self.copy_calls = [], []
        for indices in kinds.values():
            members = [linears[i] for i in indices]
            sizes = [linear.out_features for linear in members]
            if isinstance(kernel_weights[indices[0]], PlanarInt4):
                stacked = concat_planar([kernel_weights[i] for i in indices])
                for linear in members:
                    linear.hand_repacked_to_group()
                copies = stack_dense_weights(members)
            else:
                stacked = copies = stack_dense_weights(members)
            self.calls.append((indices, stacked, sizes))
            self.copy_calls.append((indices, copies, sizes))

    def _matmuls(self) -> list[tuple[list[int], object, list[int]]]:
        """The calls this context reads: `copy_calls` under `reading_bf16_copies`."""
        return self.copy_calls if _READING_BF16_COPIES.get() else self.calls

    def accepts(self, x: torch.Tensor) -> bool:
        return fits_row_kernel(x, self.max_kernel_rows)

    @property
    def is_one_matmul(self) -> bool:
        """Whether all members are of one kind, so `stacked` gives their outputs side by side."""
        return len(self.calls) == 1

    def stacked(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] → the members' outputs side by side [..., ΣN_i], in the order given, from
        one matmul (needs `is_one_matmul`)."""
        if not self.is_one_matmul:
            raise ValueError("stacked: the group's linears are of more than one kind")
        _indices, weight, _sizes = self._matmuls()[0]
        out = row_kernel_matmul(x.reshape(-1, x.shape[-1]).contiguous(), weight)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def __call__(
        self, x: torch.Tensor, keep_splits_of: Collection[int] = ()
    ) -> list[torch.Tensor | SplitSums]:
        """x [..., K] → each linear's output [..., N_i], in the order given (possibly views).
        keep_splits_of: members (indices) whose outputs may stay a K-split matmul's partial
        sums (`SplitSums` column slices), for consumers that add them up themselves; a
        matmul's splits are kept only if all its members are listed."""
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        outputs: list[torch.Tensor | SplitSums | None] = [None] * len(self.linears)
        for indices, stacked, sizes in self._matmuls():
            keep_splits = all(index in keep_splits_of for index in indices)
            stacked_out = row_kernel_matmul(rows, stacked, keep_splits)
            start = 0
            for index, size in zip(indices, sizes, strict=True):
                if isinstance(stacked_out, SplitSums):
                    part = stacked_out.columns(start, start + size)
                else:
                    part = stacked_out[:, start : start + size]
                outputs[index] = part.reshape(*x.shape[:-1], size)
                start += size
        return outputs
