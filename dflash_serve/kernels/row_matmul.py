"""`y = x @ Wᵀ` for verify/decode rows (16 tokens × the batch), bf16 weights, row-independent.

Speculative output equals target-only output only if a token's result does not depend on how
many tokens share the launch. Rows are processed in tiles of `block_m` rows (16, or 64 for
Hopper's warpgroup MMA, which makes a batch of verify blocks nearly as cheap as one) and every
launch parameter comes from the weight's shape and kind alone (`matmul_config`), so each row
tile runs the same instruction sequence over K whatever M is; padded rows are masked to zero
and never mix with real ones. A config may swap the operands (`swap_ab`: each tile computed
as W-tile · x-tileᵀ, the token rows on the MMA's narrow side) — again per shape, never per
call. Split-K partials are summed by a second kernel in a fixed order,
never with atomics. Calls of WIDE_MIN_ROWS rows or more (prompts prefilled together) take
`WideLaunch` tiles instead (unless the config swaps operands): the same K splits, summed in
the same order inside each program, so the same bits on the GPU; on Hopper their operands
are loaded through TMA descriptors, with tiles chosen by the call's rows. Those tiles and K
steps do depend on the call, so the wide launch's bits rest on a property of the MMA (each
output element's chain of k16 steps in K order is the same for any tile): measured on
Hopper shape by shape, a new weight shape or GPU generation needs the GPU test
(`test_qwen35_4b_shapes_wide_launch`). (Under the interpreter a tile's dot is numpy's,
whose order may follow the tile's shape: there the wide launch's bits are only checked with
the split launch's tile shapes.)

4-bit weights read packed go through `w4a16_matmul` (its own layout and kernel); a 4-bit
layer reading its dequantized bf16 copy comes here like any dense one.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from dflash_serve.kernels import is_hopper_or_newer, is_interpreting, launch_options
from dflash_serve.kernels.jit_math import (
    dot_in,
    grouped_tile,
    round_to,
    store_row_tile,
    summed_splits,
    wait_for_inputs,
)
from dflash_serve.layers.split_sums import SplitSums

BLOCK_M = 16
BLOCK_MS = (16, 64)
NUM_SMS = 132  # H200; a constant, so the config never depends on the machine either
MIN_PROGRAMS = 2 * NUM_SMS
MAX_BLOCK_N = 64
BLOCK_K = 64
MIN_BLOCKS_PER_SPLIT = 2
MIN_DOT_K = 16
REDUCE_BLOCK = 1024
TUNED_CONFIGS_PATH = Path(__file__).with_name("row_matmul_configs.json")
# Calls of at least this many rows (prompts prefilled on the kernel path) take `WideLaunch`.
WIDE_MIN_ROWS = 512


@dataclass(frozen=True)
class MatmulConfig:
    """One launch: row tiles of block_m, output tiles of block_n, K in split_k slices of
    k_per_split (a multiple of block_k; the last may be shorter), block_k per loop step.
    A program serves up to row_tiles row tiles (1, 2, 4 or 8) with each weight tile it loads,
    one tile-sized dot per row tile, so several verify blocks share one weight read.
    swap_ab computes the transposed tile, Wᵀ-tile · xᵀ-tile: the weight tile is the MMA's
    tall operand (block_n rows) and the token rows its narrow side, so a 16-row verify block
    is not padded to Hopper's 64-row warpgroup MMA."""

    block_n: int
    block_k: int
    k_per_split: int
    split_k: int
    num_warps: int
    num_stages: int
    block_m: int = BLOCK_M
    row_tiles: int = 1
    swap_ab: bool = False

    def __post_init__(self) -> None:
        if self.row_tiles not in (1, 2, 4, 8):
            raise ValueError(f"row_tiles must be 1, 2, 4 or 8, got {self.row_tiles}")
        if self.block_m not in BLOCK_MS:
            raise ValueError(f"block_m must be one of {BLOCK_MS}, got {self.block_m}")

    @classmethod
    def over_splits(
        cls,
        k: int,
        block_n: int,
        block_k: int,
        blocks_per_split: int,
        row_tiles: int = 1,
        block_m: int = BLOCK_M,
        num_warps: int = 4,
        num_stages: int = 3,
        swap_ab: bool = False,
    ) -> MatmulConfig:
        """K cut into splits of `blocks_per_split` BLOCK_K blocks (the last may be shorter)."""
        return cls(
            block_n=block_n,
            block_k=block_k,
            k_per_split=blocks_per_split * block_k,
            split_k=triton.cdiv(triton.cdiv(k, block_k), blocks_per_split),
            num_warps=num_warps,
            num_stages=num_stages,
            block_m=block_m,
            row_tiles=row_tiles,
            swap_ab=swap_ab,
        )


@dataclass(frozen=True)
class WideLaunch:
    """How a call of many rows (prefill) is tiled: one program per block_m × block_n output
    tile that walks all of K, adding the shape's K splits (its `MatmulConfig`) up in split
    order as it goes. A row's bits are those of the split launch, without fp32 partials in
    memory or a second kernel, and each weight tile feeds block_m rows, not 16 or 64.
    Programs of group_m consecutive row tiles share a column band (its weight tiles stay in
    L2 while they are read). block_k: the K step (None: the config's), one that divides the
    config's splits; on the GPU a step of another size gives the same bits, since each output
    element's MMA chain is the same k16 steps in K order (the interpreter's numpy dot may
    follow the tile's shape instead: there the tests keep the config's)."""

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 8
    block_k: int | None = None

    def k_step(self, config: MatmulConfig) -> int:
        """The K step this launch takes for `config`: its own where that divides the
        config's splits, else the config's."""
        if self.block_k is None or config.k_per_split % self.block_k:
            return config.block_k
        return self.block_k


# 128 × 128, 8 warps, 3 stages: on an H100 (2026-12-05, bench/results/
# prefill-wide-launch-2026-12-05-nvidia-h100.json) the per-forward matmul time at 512 / 1024 /
# 2048 rows fell from 12.8 / 24.7 / 48.3 ms (split launch) to 8.7 / 16.9 / 31.5 ms, cuBLAS
# 5.5 / 10.3 / 19.5 ms; same bits for every tile shape tried. The tiles of loads through
# pointers (`_wide_matmul_kernel`: GPUs without TMA, operands TMA cannot read).
WIDE_LAUNCH = WideLaunch()
# The tiles of loads through TMA descriptors (`_wide_tma_matmul_kernel`, Hopper), by the
# call's rows: the largest minimum it reaches. On an H100 (2026-12-06, bench/results/
# wide-tma-2026-12-06-nvidia-h100.json; five dense Qwen3.5-4B prefill shapes weighted by
# their count per forward) 7.35 ms at 512 rows and 12.19 at 1024, against 8.62 / 16.88 ms
# through pointers and cuBLAS's 5.51 / 10.32; the same bits as the split launch for all.
# K steps of 64 for all (the shapes whose split launch steps 128 gave its bits too).
TMA_WIDE_LAUNCHES = (
    (WIDE_MIN_ROWS, WideLaunch(block_m=128, block_n=128, num_warps=8, num_stages=4, block_k=64)),
    (1024, WideLaunch(block_m=128, block_n=256, num_warps=8, num_stages=3, block_k=64)),
)
# `row_matmul`'s default `wide`: the shipped tiles for the call's rows and loads.
BY_ROWS = "by_rows"
TMA_ALIGNMENT = 16  # bytes: a TMA descriptor's base address and row stride


def tma_wide_launch(rows: int) -> WideLaunch:
    """The TMA wide launch's tiles for a call of `rows` (at least WIDE_MIN_ROWS) rows."""
    fitting = [launch for min_rows, launch in TMA_WIDE_LAUNCHES if rows >= min_rows]
    if not fitting:
        raise ValueError(f"the wide launch takes at least {WIDE_MIN_ROWS} rows, got {rows}")
    return fitting[-1]


def tma_loads_fit(*operands: torch.Tensor) -> bool:
    """Whether TMA descriptors can read these 2-D operands (unit last stride): a GPU with TMA
    (Hopper or newer, tuned and checked on Hopper; the interpreter emulates it), rows that
    do not overlap, and base addresses and row strides of 16-byte multiples."""
    device = operands[0].device
    if not is_interpreting() and not (device.type == "cuda" and is_hopper_or_newer(device.index)):
        return False
    return all(
        t.stride(0) >= t.shape[1]
        and t.data_ptr() % TMA_ALIGNMENT == 0
        and (t.stride(0) * t.element_size()) % TMA_ALIGNMENT == 0
        for t in operands
    )


def matmul_config(n: int, k: int) -> MatmulConfig:
    """Launch parameters for a bf16 [N, K] weight.

    Depends on (N, K) only, never on the row count: that is what makes rows independent.
    A configuration measured for the shape on the H200 (`tuned_configs`) wins. Otherwise:
    decode and verify are memory-bound (each row tile streams the whole weight once), so the
    aim is to keep every SM streaming: SPLIT_K is the smallest split (in whole BLOCK_K blocks)
    that gives at least 2 × 132 programs for one row tile, but every split keeps a loop of at
    least 2 blocks to pipeline. The extra traffic, fp32 partials [SPLIT_K, M, N] written and
    summed once, is small beside the weight for M <= 128.
    """
    tuned = tuned_configs().get(config_key(n, k))
    if tuned is not None:
        return MatmulConfig(**tuned)
    block_n = max(MIN_DOT_K, min(MAX_BLOCK_N, triton.next_power_of_2(n)))
    num_tiles = triton.cdiv(n, block_n)
    num_blocks = triton.cdiv(k, BLOCK_K)
    wanted_splits, blocks_per_split = 1, num_blocks
    while (
        num_tiles * triton.cdiv(num_blocks, blocks_per_split) < MIN_PROGRAMS
        and blocks_per_split > MIN_BLOCKS_PER_SPLIT
    ):
        wanted_splits += 1
        blocks_per_split = max(MIN_BLOCKS_PER_SPLIT, triton.cdiv(num_blocks, wanted_splits))
    return MatmulConfig.over_splits(k, block_n, BLOCK_K, blocks_per_split)


def config_key(n: int, k: int) -> str:
    return f"dense:{n}x{k}"


@functools.cache
def tuned_configs() -> dict[str, dict]:
    """Per-shape launch configs measured on an H200 (bench/tune_row_matmul.py), by
    `config_key`; shapes not listed use the heuristic of `matmul_config`."""
    if not TUNED_CONFIGS_PATH.exists():
        return {}
    return json.loads(TUNED_CONFIGS_PATH.read_text())["configs"]


@triton.jit
def _x_tile_dot(
    x_ptr, row0, M, stride_xm, offs_k, k_mask, w, acc,
    BLOCK_M: tl.constexpr, DOT_IN_FP32: tl.constexpr, SWAP_AB: tl.constexpr,
):  # fmt: skip
    """acc [BLOCK_M, BLOCK_N] + x-tile @ w, w [BLOCK_K, BLOCK_N]; SWAP_AB: acc [BLOCK_N,
    BLOCK_M] + w @ x-tileᵀ, w [BLOCK_N, BLOCK_K]."""
    offs_m = row0 + tl.arange(0, BLOCK_M)
    if SWAP_AB:
        x_ptrs = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None]
        x = tl.load(x_ptrs, mask=(offs_m[None, :] < M) & k_mask[:, None], other=0.0)
        acc = dot_in(w, x, acc, DOT_IN_FP32)
    else:
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
        x = tl.load(x_ptrs, mask=(offs_m[:, None] < M) & k_mask[None, :], other=0.0)
        acc = dot_in(x, w, acc, DOT_IN_FP32)
    return acc


@triton.jit
def _row_tile_dot(
    x_ptr, row0, M, stride_xm, offs_k, k_mask, w, acc,
    BLOCK_M: tl.constexpr, DOT_IN_FP32: tl.constexpr, MAY_BE_EMPTY: tl.constexpr,
    SWAP_AB: tl.constexpr,
):  # fmt: skip
    """acc + x[row0 : row0 + BLOCK_M, offs_k] @ w. A program's first tile always has rows;
    a later one (MAY_BE_EMPTY) with none (row0 >= M) is skipped, so spare row tiles cost a
    branch, not a dot."""
    if MAY_BE_EMPTY:
        if row0 < M:
            acc = _x_tile_dot(
                x_ptr, row0, M, stride_xm, offs_k, k_mask, w, acc, BLOCK_M, DOT_IN_FP32, SWAP_AB
            )
    else:
        acc = _x_tile_dot(
            x_ptr, row0, M, stride_xm, offs_k, k_mask, w, acc, BLOCK_M, DOT_IN_FP32, SWAP_AB
        )
    return acc


@triton.jit
def _tiles_step(
    x_ptr, row0, M, stride_xm, offs_k, k_mask, w, acc0, acc1, acc2, acc3, acc4, acc5, acc6,
    acc7, BLOCK_M: tl.constexpr, ROW_TILES: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    SWAP_AB: tl.constexpr,
):  # fmt: skip
    """One weight tile against each of the program's row tiles. Every row tile runs the same
    BLOCK_M-row dot in the same K order whatever ROW_TILES is, so a row's result does not
    depend on how many tiles share the program (accumulators past ROW_TILES are unused)."""
    acc0 = _row_tile_dot(
        x_ptr, row0, M, stride_xm, offs_k, k_mask, w, acc0, BLOCK_M, DOT_IN_FP32, False, SWAP_AB
    )
    if ROW_TILES > 1:
        row1 = row0 + BLOCK_M
        acc1 = _row_tile_dot(
            x_ptr, row1, M, stride_xm, offs_k, k_mask, w, acc1, BLOCK_M, DOT_IN_FP32, True, SWAP_AB
        )
    if ROW_TILES > 2:
        row2, row3 = row0 + 2 * BLOCK_M, row0 + 3 * BLOCK_M
        acc2 = _row_tile_dot(
            x_ptr, row2, M, stride_xm, offs_k, k_mask, w, acc2, BLOCK_M, DOT_IN_FP32, True, SWAP_AB
        )
        acc3 = _row_tile_dot(
            x_ptr, row3, M, stride_xm, offs_k, k_mask, w, acc3, BLOCK_M, DOT_IN_FP32, True, SWAP_AB
        )
    if ROW_TILES > 4:
        row4, row5 = row0 + 4 * BLOCK_M, row0 + 5 * BLOCK_M
        row6, row7 = row0 + 6 * BLOCK_M, row0 + 7 * BLOCK_M
        acc4 = _row_tile_dot(
            x_ptr, row4, M, stride_xm, offs_k, k_mask, w, acc4, BLOCK_M, DOT_IN_FP32, True, SWAP_AB
        )
        acc5 = _row_tile_dot(
            x_ptr, row5, M, stride_xm, offs_k, k_mask, w, acc5, BLOCK_M, DOT_IN_FP32, True, SWAP_AB
        )
        acc6 = _row_tile_dot(
            x_ptr, row6, M, stride_xm, offs_k, k_mask, w, acc6, BLOCK_M, DOT_IN_FP32, True, SWAP_AB
        )
        acc7 = _row_tile_dot(
            x_ptr, row7, M, stride_xm, offs_k, k_mask, w, acc7, BLOCK_M, DOT_IN_FP32, True, SWAP_AB
        )
    return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7


@triton.jit
def _store_tiles(
    out_ptr, row0, offs_n, M, N, stride_os, stride_om, acc0, acc1, acc2, acc3, acc4, acc5,
    acc6, acc7, BLOCK_M: tl.constexpr, ROW_TILES: tl.constexpr, SPLIT_K: tl.constexpr,
    ROUND_ON_BITS: tl.constexpr, SWAP_AB: tl.constexpr,
):  # fmt: skip
    store_row_tile(out_ptr, acc0, row0, offs_n, M, N, stride_os, stride_om,
                BLOCK_M, SPLIT_K, ROUND_ON_BITS, SWAP_AB)  # fmt: skip
    if ROW_TILES > 1:
        store_row_tile(out_ptr, acc1, row0 + BLOCK_M, offs_n, M, N, stride_os, stride_om,
                    BLOCK_M, SPLIT_K, ROUND_ON_BITS, SWAP_AB)  # fmt: skip
    if ROW_TILES > 2:
        store_row_tile(out_ptr, acc2, row0 + 2 * BLOCK_M, offs_n, M, N, stride_os, stride_om,
                    BLOCK_M, SPLIT_K, ROUND_ON_BITS, SWAP_AB)  # fmt: skip
        store_row_tile(out_ptr, acc3, row0 + 3 * BLOCK_M, offs_n, M, N, stride_os, stride_om,
                    BLOCK_M, SPLIT_K, ROUND_ON_BITS, SWAP_AB)  # fmt: skip
    if ROW_TILES > 4:
        store_row_tile(out_ptr, acc4, row0 + 4 * BLOCK_M, offs_n, M, N, stride_os, stride_om,
                    BLOCK_M, SPLIT_K, ROUND_ON_BITS, SWAP_AB)  # fmt: skip
        store_row_tile(out_ptr, acc5, row0 + 5 * BLOCK_M, offs_n, M, N, stride_os, stride_om,
                    BLOCK_M, SPLIT_K, ROUND_ON_BITS, SWAP_AB)  # fmt: skip
        store_row_tile(out_ptr, acc6, row0 + 6 * BLOCK_M, offs_n, M, N, stride_os, stride_om,
                    BLOCK_M, SPLIT_K, ROUND_ON_BITS, SWAP_AB)  # fmt: skip
        store_row_tile(out_ptr, acc7, row0 + 7 * BLOCK_M, offs_n, M, N, stride_os, stride_om,
                    BLOCK_M, SPLIT_K, ROUND_ON_BITS, SWAP_AB)  # fmt: skip


@triton.jit
def _weight_tile(
    w_ptr, stride_wn, offs_k, offs_n, N: tl.constexpr, K: tl.constexpr, SWAP_AB: tl.constexpr
):  # fmt: skip
    """The bf16 tile W[offs_n, offs_k]ᵀ, [BLOCK_K, BLOCK_N] (SWAP_AB: W[offs_n, offs_k],
    [BLOCK_N, BLOCK_K]), zero outside the weight."""
    n_mask = offs_n < N
    if SWAP_AB:
        w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
        w = tl.load(w_ptrs, mask=(offs_k[None, :] < K) & n_mask[:, None], other=0.0)
    else:
        w_ptrs = w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None]
        w = tl.load(w_ptrs, mask=(offs_k[:, None] < K) & n_mask[None, :], other=0.0)
    return w


@triton.jit(do_not_specialize=["M", "stride_os"])
def _row_matmul_kernel(
    x_ptr, w_ptr, out_ptr, M, stride_xm, stride_wn, stride_os, stride_om,
    N: tl.constexpr, K: tl.constexpr, K_PER_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROW_TILES: tl.constexpr, SPLIT_K: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, ROUND_ON_BITS: tl.constexpr, SWAP_AB: tl.constexpr,
):  # fmt: skip
    """Program (i, j, s): row tiles i·ROW_TILES.., output columns j·BLOCK_N.., K split s.
    One weight tile per loop step, used by each of the program's row tiles."""
    wait_for_inputs()
    row0 = tl.program_id(0) * (BLOCK_M * ROW_TILES)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = tl.program_id(2) * K_PER_SPLIT
    if SWAP_AB:
        acc0 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc1, acc2, acc3, acc4, acc5, acc6, acc7 = acc0, acc0, acc0, acc0, acc0, acc0, acc0
    for k0 in range(k_start, tl.minimum(k_start + K_PER_SPLIT, K), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = _weight_tile(w_ptr, stride_wn, offs_k, offs_n, N, K, SWAP_AB)
        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _tiles_step(
            x_ptr, row0, M, stride_xm, offs_k, offs_k < K, w,
            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, BLOCK_M, ROW_TILES, DOT_IN_FP32,
            SWAP_AB,
        )  # fmt: skip
    _store_tiles(out_ptr, row0, offs_n, M, N, stride_os, stride_om,
                 acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7,
                 BLOCK_M, ROW_TILES, SPLIT_K, ROUND_ON_BITS, SWAP_AB)  # fmt: skip


@triton.jit
def _join_ended_split(
    acc, total, k0, K: tl.constexpr, K_PER_SPLIT: tl.constexpr, BLOCK_K: tl.constexpr
):  # fmt: skip
    """(acc, total) after the wide kernels' dot at k0: where that ends a K split, the split's
    sum joins the total and the next split starts from zero; split 0's sum is taken as it is
    (0 + p0 would turn a -0.0 into +0.0), then p0 + p1 … (the order of `summed_splits`)."""
    if ((k0 + BLOCK_K) % K_PER_SPLIT == 0) | (k0 + BLOCK_K >= K):
        total = tl.where(k0 < K_PER_SPLIT, acc, total + acc)
        acc = tl.zeros_like(acc)
    return acc, total


@triton.jit(do_not_specialize=["M"])
def _wide_matmul_kernel(
    x_ptr, w_ptr, out_ptr, M, stride_xm, stride_wn, stride_om,
    N: tl.constexpr, K: tl.constexpr, K_PER_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, ROUND_ON_BITS: tl.constexpr,
):  # fmt: skip
    """Program p: one output tile (`grouped_tile`). Each split's sum starts from zero, as in
    `_row_matmul_kernel`, and joins the total when the split ends: total = ((s0 + s1) + s2)
    …, the order of `summed_splits`."""
    wait_for_inputs()
    row_tile, col_tile = grouped_tile(tl.program_id(0), M, BLOCK_M, (N + BLOCK_N - 1) // BLOCK_N,
                                      GROUP_M)  # fmt: skip
    row0 = row_tile * BLOCK_M
    offs_n = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = _weight_tile(w_ptr, stride_wn, offs_k, offs_n, N, K, False)
        acc = _x_tile_dot(
            x_ptr, row0, M, stride_xm, offs_k, offs_k < K, w, acc, BLOCK_M, DOT_IN_FP32, False
        )
        acc, total = _join_ended_split(acc, total, k0, K, K_PER_SPLIT, BLOCK_K)
    store_row_tile(out_ptr, total, row0, offs_n, M, N, 0, stride_om, BLOCK_M, 1,
                   ROUND_ON_BITS, False)  # fmt: skip


@triton.jit(do_not_specialize=["M"])
def _wide_tma_matmul_kernel(
    x_desc, w_desc, out_ptr, M, stride_om,
    N: tl.constexpr, K: tl.constexpr, K_PER_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, ROUND_ON_BITS: tl.constexpr,
):  # fmt: skip
    """`_wide_matmul_kernel` with its x and weight tiles loaded through TMA descriptors
    (zero outside the operands, so no masks): the same k16 MMA chain in K order and the same
    split sums (its K step may differ from the config's), so the same bits; the copy engine
    frees the warps from address arithmetic and loads."""
    wait_for_inputs()
    row_tile, col_tile = grouped_tile(tl.program_id(0), M, BLOCK_M, (N + BLOCK_N - 1) // BLOCK_N,
                                      GROUP_M)  # fmt: skip
    row0, col0 = row_tile * BLOCK_M, col_tile * BLOCK_N
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = x_desc.load([row0, k0])
        w = w_desc.load([col0, k0])
        acc = dot_in(x, w.T, acc, DOT_IN_FP32)
        acc, total = _join_ended_split(acc, total, k0, K, K_PER_SPLIT, BLOCK_K)
    offs_n = col0 + tl.arange(0, BLOCK_N)
    store_row_tile(out_ptr, total, row0, offs_n, M, N, 0, stride_om, BLOCK_M, 1,
                   ROUND_ON_BITS, False)  # fmt: skip


@triton.jit(do_not_specialize=["M"])
def _sum_splits_kernel(
    partial_ptr, out_ptr, M, stride_om,
    N: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, ROUND_ON_BITS: tl.constexpr,
):  # fmt: skip
    wait_for_inputs()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = summed_splits(partial_ptr, offs, mask, M * N, SPLIT_K)
    out_ptrs = out_ptr + (offs // N) * stride_om + offs % N
    tl.store(out_ptrs, round_to(acc, tl.bfloat16, ROUND_ON_BITS), mask=mask)


def sum_splits(partials: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 split-K partial sums [S, M, N] → bf16 [M, N] (`out` if given, unit last stride):
    the splits added in order in fp32, then one rounding."""
    splits, m, n = partials.shape
    if out is None:
        out = torch.empty((m, n), dtype=torch.bfloat16, device=partials.device)
    if m:
        _sum_splits_kernel[(triton.cdiv(m * n, REDUCE_BLOCK),)](
            partials, out, m, out.stride(0), N=n, SPLIT_K=splits, BLOCK=REDUCE_BLOCK,
            ROUND_ON_BITS=is_interpreting(), num_warps=4, **launch_options(),
        )  # fmt: skip
    return out


def row_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor | None = None,
    config: MatmulConfig | None = None,
    keep_splits: bool = False,
    wide: WideLaunch | str | None = BY_ROWS,
) -> torch.Tensor | SplitSums:
    """`x @ weightᵀ` with fp32 accumulation and one rounding to bf16; rows are independent.

    x: bf16 [M, K] with unit last stride; weight: bf16 [N, K] with unit last stride; out:
    optional bf16 [M, N] with unit last stride. Returns out (or a new [M, N] tensor). Row m
    of the result is bit-identical for any M. No host synchronisation; the only allocation
    (split-K partials) depends on shapes alone.
    keep_splits: where the shape's configuration splits K, return the partial sums unsummed
    (`SplitSums`, for a consumer that adds them up itself; `out` is then not written).
    wide: how calls of at least WIDE_MIN_ROWS rows are tiled (`WideLaunch`: same bits, splits
    summed inside; such a call returns the bf16 result even with keep_splits, which its
    consumers turn into the same bits; BY_ROWS: the shipped tiles for the call's rows and
    loads, `TMA_WIDE_LAUNCHES` or `WIDE_LAUNCH`); None: every call through the split launch.
    """
    n, k = _check_weight(weight, x)
    check_rows(x, k)
    if not (wide is None or wide == BY_ROWS or isinstance(wide, WideLaunch)):
        raise ValueError(f"wide must be a WideLaunch, BY_ROWS or None, got {wide!r}")
    m = x.shape[0]
    if config is None:  # (explicit configs: tuning and tests only, never per call site)
        config = matmul_config(n, k)
    if wide is not None and m >= WIDE_MIN_ROWS and not config.swap_ab:
        return _wide_matmul(x, weight, RowOutput.for_call(x, n, 1, out, keep_splits).out,
                            config, wide)  # fmt: skip
    target = RowOutput.for_call(x, n, config.split_k, out, keep_splits)
    if m == 0:
        return target.result()
    stride_os, stride_om = target.strides
    rows_per_program = config.block_m * config.row_tiles
    grid = (triton.cdiv(m, rows_per_program), triton.cdiv(n, config.block_n), config.split_k)
    shape_args = {"N": n, "K": k, "K_PER_SPLIT": config.k_per_split, "BLOCK_M": config.block_m}
    shape_args |= {"ROW_TILES": config.row_tiles, "SWAP_AB": config.swap_ab}
    shape_args |= {"BLOCK_N": config.block_n, "BLOCK_K": config.block_k, "SPLIT_K": config.split_k}
    is_interpreted = is_interpreting()
    launch_args = {"DOT_IN_FP32": is_interpreted, "ROUND_ON_BITS": is_interpreted}
    launch_args |= {"num_warps": config.num_warps, "num_stages": config.num_stages}
    launch_args |= launch_options()
    _row_matmul_kernel[grid](
        x, weight, target.written, m, x.stride(0), weight.stride(0), stride_os, stride_om,
        **shape_args, **launch_args,
    )  # fmt: skip
    return target.result()


def _wide_matmul(
    x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, config: MatmulConfig,
    wide: WideLaunch | str,
) -> torch.Tensor:  # fmt: skip
    """`row_matmul` through a wide kernel: config's K order, wide's tiles; x and the weight
    loaded through TMA descriptors where they can be (`tma_loads_fit`), else through
    pointers."""
    m, (n, k) = x.shape[0], weight.shape
    uses_tma = tma_loads_fit(x, weight)
    if wide == BY_ROWS:
        wide = tma_wide_launch(m) if uses_tma else WIDE_LAUNCH
    grid = (triton.cdiv(m, wide.block_m) * triton.cdiv(n, wide.block_n),)
    is_interpreted = is_interpreting()
    shape_args = {"N": n, "K": k, "K_PER_SPLIT": config.k_per_split, "BLOCK_M": wide.block_m}
    block_k = wide.k_step(config)
    shape_args |= {"BLOCK_N": wide.block_n, "BLOCK_K": block_k, "GROUP_M": wide.group_m}
    launch_args = {"DOT_IN_FP32": is_interpreted, "ROUND_ON_BITS": is_interpreted}
    launch_args |= {"num_warps": wide.num_warps, "num_stages": wide.num_stages}
    launch_args |= launch_options()
    if uses_tma:
        x_desc = TensorDescriptor.from_tensor(x, [wide.block_m, block_k])
        w_desc = TensorDescriptor.from_tensor(weight, [wide.block_n, block_k])
        _wide_tma_matmul_kernel[grid](
            x_desc, w_desc, out, m, out.stride(0), **shape_args, **launch_args
        )  # fmt: skip
    else:
        _wide_matmul_kernel[grid](
            x, weight, out, m, x.stride(0), weight.stride(0), out.stride(0), **shape_args,
            **launch_args,
        )  # fmt: skip
    return out


@dataclass(frozen=True)
class RowOutput:
    """Where a row kernel writes: the bf16 result [M, N] (`out`, given or new), or, when
    the shape's configuration splits K, fp32 partials [SPLIT_K, M, N] that are summed into it
    in split order, or handed on unsummed (keep_splits: `out` is then None)."""

    out: torch.Tensor | None
    partials: torch.Tensor | None

    @classmethod
    def for_call(
        cls, x: torch.Tensor, n: int, split_k: int, out: torch.Tensor | None, keep_splits: bool
    ) -> RowOutput:
        m = x.shape[0]
        if keep_splits and out is not None:
            raise ValueError("keep_splits: the partial sums are the result, give no out")
        if split_k > 1 and keep_splits and m:
            out = None
        elif out is None:
            out = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
        else:
            check_out(out, m, n, x.device)
        partials = None
        if split_k > 1 and m:
            partials = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
        return cls(out, partials)

    @property
    def written(self) -> torch.Tensor:
        """What the kernel writes."""
        return self.out if self.partials is None else self.partials

    @property
    def strides(self) -> tuple[int, int]:
        """(stride between splits, stride between rows) of `written`."""
        if self.partials is None:
            return 0, self.out.stride(0)
        return self.partials.stride(0), self.partials.stride(1)

    def result(self) -> torch.Tensor | SplitSums:
        """After the kernel: out (the splits summed into it), or the partials unsummed."""
        if self.partials is None:
            return self.out
        if self.out is None:
            _, m, n = self.partials.shape
            return SplitSums(self.partials, (m, n))
        return sum_splits(self.partials, self.out)


def row_matmul_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 [M, N]: `x.float() @ w.float()ᵀ`."""
    return x.float() @ weight.float().t()


def _check_weight(weight: torch.Tensor, x: torch.Tensor) -> tuple[int, int]:
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"weight must be a bf16 tensor, got {type(weight).__name__}")
    if weight.dim() != 2 or weight.dtype != torch.bfloat16 or weight.stride(-1) != 1:
        raise ValueError(f"weight must be bf16 [N, K] with unit last stride, got {weight.dtype} "
                         f"{tuple(weight.shape)} strides {weight.stride()}")  # fmt: skip
    if weight.device != x.device:
        raise ValueError(f"weight must be on {x.device}, got {weight.device}")
    return weight.shape[0], weight.shape[1]


def check_rows(x: torch.Tensor, k: int) -> None:
    """A row kernel's input: bf16 [M, k] with a unit last stride (named errors otherwise)."""
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}], got {tuple(x.shape)}")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"x must be bf16, got {x.dtype}")
    if x.stride(1) != 1:
        raise ValueError(f"x must have a unit last stride, got strides {x.stride()}")


def check_out(out: torch.Tensor, m: int, n: int, device: torch.device) -> None:
    """A row kernel's `out`: bf16 [m, n] on `device` with a unit last stride."""
    if out.shape != (m, n) or out.dtype != torch.bfloat16 or out.device != device:
        raise ValueError(f"out must be bf16 ({m}, {n}) on {device}, got {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")  # fmt: skip
    if out.stride(1) != 1:
        raise ValueError(f"out must have a unit last stride, got strides {out.stride()}")
