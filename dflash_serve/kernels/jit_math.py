"""Triton device functions several kernels share: the wait every kernel starts with, an exp
that matches torch's, fp32 rounding to a narrower dtype that Triton's interpreter gets right,
the sigmoid of `dflash_serve.layers.activations` as torch computes it, and the matmuls' dot
and tile store.

On the GPU `exact_exp` is libdevice's `expf` (what torch's CUDA kernels call; `tl.exp` is
approximate there) and `round_to` is the plain round-to-nearest-even cast. Triton's CPU
interpreter has no libdevice, and its fp32 → bf16 cast truncates (Triton 3.9), so there
`INTERPRETED` selects `tl.exp` and a rounding done on the bits first.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from dflash_serve.kernels import is_interpreting

# Decided at import, as `triton.jit` decides at decoration whether kernels are interpreted.
_INTERPRETED = tl.constexpr(is_interpreting())


@triton.jit
def wait_for_inputs():
    """Every kernel's first statement. Under programmatic dependent launch
    (`kernels.programmatic_launch`) a kernel's programs may start while the kernel before it
    still runs: wait here until it has finished and its writes are visible, before any load
    or store, then let the kernel after this one be scheduled. Launched without PDL, and
    under the interpreter, this costs nothing and changes nothing."""
    if not _INTERPRETED:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def exact_exp(x, INTERPRETED: tl.constexpr):
    if INTERPRETED:
        return tl.exp(x)
    return libdevice.exp(x)


@triton.jit
def round_to(x, DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """fp32 `x` rounded to nearest even in DTYPE."""
    if INTERPRETED and DTYPE == tl.bfloat16:  # noqa: SIM300 (DTYPE is a constexpr)
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True).to(DTYPE)
    return x.to(DTYPE)


@triton.jit
def sigmoid_in(x, DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """`activations.sigmoid`, 1 / (1 + exp(−x)), as torch evaluates it on a DTYPE tensor: each
    op in fp32, its result rounded to DTYPE (no rounding for fp32), division IEEE. x: fp32
    holding DTYPE values; returns fp32 holding a DTYPE value, bit for bit torch's on the GPU."""
    e = round_to(exact_exp(-x, INTERPRETED), DTYPE, INTERPRETED).to(tl.float32)
    s = round_to(1.0 + e, DTYPE, INTERPRETED).to(tl.float32)
    return round_to(tl.div_rn(1.0, s), DTYPE, INTERPRETED).to(tl.float32)


@triton.jit
def summed_splits(partial_ptr, offs, mask, split_stride, SPLIT_K: tl.constexpr):
    """Σ_s partial[s] at `offs`, in fp32, split 0 first: the one order every consumer of
    split-K partial sums adds them in (`row_matmul`'s sum kernel, `add_rms_norm`)."""
    acc = tl.load(partial_ptr + offs, mask=mask, other=0.0)
    for split in tl.static_range(1, SPLIT_K):
        acc += tl.load(partial_ptr + split * split_stride + offs, mask=mask, other=0.0)
    return acc


@triton.jit
def load_summed(ptr, offs, mask, split_stride, SPLITS: tl.constexpr, INTERPRETED: tl.constexpr):
    """fp32 values at ptr + offs of an input, or (SPLITS > 0) of a matmul result left as
    split-K partial sums (`SplitSums`): summed in split order and rounded to bf16 exactly as
    `row_matmul`'s sum kernel would have, so a consumer gives the same bits either way."""
    if SPLITS > 0:
        summed = summed_splits(ptr, offs, mask, split_stride, SPLITS)
        return round_to(summed, tl.bfloat16, INTERPRETED).to(tl.float32)
    return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def dot_in(a, b, acc, DOT_IN_FP32: tl.constexpr):
    """acc + a @ b; DOT_IN_FP32 (the interpreter, whose bf16 dot is wrong) multiplies fp32
    copies, in which products of bf16 values are exact."""
    if DOT_IN_FP32:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def grouped_tile(pid, M, BLOCK_M: tl.constexpr, NUM_COL_TILES: tl.constexpr,
                 GROUP_M: tl.constexpr):  # fmt: skip
    """(row tile, column tile) of program `pid` in a one-dimensional grid of output tiles:
    GROUP_M consecutive row tiles take a column band together, so the programs running at
    one time share weight tiles (in L2) as well as row tiles."""
    per_group = GROUP_M * NUM_COL_TILES
    first_row_tile = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tl.cdiv(M, BLOCK_M) - first_row_tile, GROUP_M)
    in_group = pid % per_group
    return first_row_tile + in_group % group_rows, in_group // group_rows


@triton.jit
def store_row_tile(
    out_ptr, acc, row0, offs_n, M, N, stride_os, stride_om,
    BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr, ROUND_ON_BITS: tl.constexpr,
    SWAP_AB: tl.constexpr,
):  # fmt: skip
    """A matmul's fp32 tile of rows row0.. into bf16 out [M, N], or as fp32 into split
    `program_id(2)` of the partials [SPLIT_K, M, N] (SWAP_AB: acc is the tile transposed,
    [BLOCK_N, BLOCK_M])."""
    offs_m = row0 + tl.arange(0, BLOCK_M)
    split_ptr = out_ptr + tl.program_id(2) * stride_os
    if SWAP_AB:
        ptrs = split_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
        mask = (offs_m[None, :] < M) & (offs_n[:, None] < N)
    else:
        ptrs = split_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SPLIT_K > 1:
        tl.store(ptrs, acc, mask=mask)
    else:
        tl.store(ptrs, round_to(acc, tl.bfloat16, ROUND_ON_BITS), mask=mask)
