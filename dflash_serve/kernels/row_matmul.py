"""`y = x @ Wᵀ` for verify/decode rows (16 tokens × the batch), dense or 4-bit, row-independent.

Speculative output equals target-only output only if a token's result does not depend on how
many tokens share the launch. Rows are processed in tiles of `block_m` rows (16, or 64 for
Hopper's warpgroup MMA, which makes a batch of verify blocks nearly as cheap as one) and every
launch parameter comes from the weight's shape and kind alone (`matmul_config`), so each row
tile runs the same instruction sequence over K whatever M is; padded rows are masked to zero
and never mix with real ones. A config may swap the operands (`swap_ab`: each tile computed
as W-tile · x-tileᵀ, the token rows on the MMA's narrow side) — again per shape, never per
call. Split-K partials are summed by a second kernel in a fixed order,
never with atomics.

4-bit weights (AutoAWQ GEMM or compressed-tensors) are repacked once at load into one layout
(`RepackedInt4`); the kernel rebuilds each weight tile as `((q - z).to(fp32) * s).to(bf16)`,
bit for bit `PackedInt4Weight.dequantize(torch.bfloat16)`.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from dflash_serve.checkpoint.int4_formats import (
    AWQ_GEMM,
    AWQ_NIBBLE_OF_COLUMN,
    COMPRESSED_TENSORS,
    CT_OFFSET,
    NIBBLES_PER_WORD,
    PackedInt4Weight,
    _pack_nibbles,
    _unpack_nibbles,
)
from dflash_serve.kernels import FP_FUSION, is_interpreting
from dflash_serve.kernels.jit_math import round_to, summed_splits
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


@dataclass(frozen=True, eq=False)
class RepackedInt4:
    """A 4-bit weight [N, K] in the layout `row_matmul` reads, whatever its checkpoint format.

    qweight: int32 [K/8, N], nibble i (bits 4i..4i+3) of word j, column n is q[n, 8j + i];
    scales: fp32 [K/g, N]; zeros: uint8 [K/g, N]. W[n, k] = (q - z) * s. N is the fast axis
    so a tile of outputs reads contiguous memory; fp32 scales are exact copies of the stored
    fp16/bf16 ones.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    out_features: int
    in_features: int
    group_size: int

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [N, K]: (q - z) * s exact in fp32, then one cast to `dtype`."""
        shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=self.qweight.device)
        q = (self.qweight.to(torch.int64)[:, None, :] >> shifts[None, :, None]) & 0xF
        q = q.reshape(self.in_features, self.out_features)
        zeros = self.zeros.to(torch.int64).repeat_interleave(self.group_size, dim=0)
        scales = self.scales.repeat_interleave(self.group_size, dim=0)
        return ((q - zeros).float() * scales).t().contiguous().to(dtype)


def concat_repacked(weights: list[RepackedInt4]) -> RepackedInt4:
    """Weights of one input (same K and group size) stacked along N: one matmul for all."""
    first = weights[0]
    if any((w.in_features, w.group_size) != (first.in_features, first.group_size) for w in weights):
        raise ValueError("weights: stacking needs one in_features and group_size for all")
    return RepackedInt4(
        qweight=torch.cat([w.qweight for w in weights], dim=1).contiguous(),
        scales=torch.cat([w.scales for w in weights], dim=1).contiguous(),
        zeros=torch.cat([w.zeros for w in weights], dim=1).contiguous(),
        out_features=sum(w.out_features for w in weights),
        in_features=first.in_features,
        group_size=first.group_size,
    )


def repack_int4(packed: PackedInt4Weight) -> RepackedInt4:
    """AWQ GEMM or compressed-tensors -> `RepackedInt4`, on the packed tensors' device (once).

    Needs K % 8 == 0 (whole words along K) and group_size a multiple of 16 dividing K (so
    the 8 inputs of a word share one group; real checkpoints use 32..128).
    """
    n, k, group_size = packed.out_features, packed.in_features, packed.group_size
    if k % NIBBLES_PER_WORD:
        raise ValueError(f"packed: in_features must be a multiple of 8, got {k}")
    if group_size <= 0 or k % group_size or group_size % MIN_DOT_K:
        raise ValueError(
            f"packed: group_size must be a multiple of {MIN_DOT_K} dividing K={k}, got {group_size}"
        )
    tensors = packed.tensors
    if packed.format == AWQ_GEMM:
        q = _unpack_nibbles(tensors["qweight"])[..., AWQ_NIBBLE_OF_COLUMN].flatten(1)
        qweight = _pack_nibbles(q.t()).t()
        zeros = _unpack_nibbles(tensors["qzeros"])[..., AWQ_NIBBLE_OF_COLUMN].flatten(1)
        scales = tensors["scales"]
    elif packed.format == COMPRESSED_TENSORS:
        qweight = tensors["weight_packed"].t()
        if "weight_zero_point" in tensors:
            zeros = _unpack_nibbles(tensors["weight_zero_point"].t()).flatten(1)[:, :n]
        else:
            zeros = torch.full((k // group_size, n), CT_OFFSET, device=qweight.device)
        scales = tensors["weight_scale"].t()
    else:
        raise ValueError(f"packed: unknown format {packed.format!r}")
    return RepackedInt4(
        qweight=qweight.to(torch.int32).contiguous(),
        scales=scales.float().contiguous(),
        zeros=zeros.to(torch.uint8).contiguous(),
        out_features=n,
        in_features=k,
        group_size=group_size,
    )


@dataclass(frozen=True)
class MatmulConfig:
    """One launch: row tiles of block_m, output tiles of block_n, K in split_k slices of
    k_per_split (a multiple of block_k; the last may be shorter), block_k per loop step.
    A program serves up to row_tiles row tiles (1, 2, 4 or 8) with each weight tile it loads,
    one tile-sized dot per row tile, so several verify blocks share one weight read.
    swap_ab computes the transposed tile, Wᵀ-tile · xᵀ-tile: the weight tile is the MMA's
    tall operand (block_n rows) and the token rows its narrow side, so a 16-row verify block
    is not padded to Hopper's 64-row warpgroup MMA. k_by_nibble (4-bit only, block_k >= 128)
    sums a tile's K in 8 dots, dot i over the inputs 8j + i (nibble i of every word): each
    nibble plane dequantizes in place, with no reshape of the unpacked words."""

    block_n: int
    block_k: int
    k_per_split: int
    split_k: int
    num_warps: int
    num_stages: int
    block_m: int = BLOCK_M
    row_tiles: int = 1
    swap_ab: bool = False
    k_by_nibble: bool = False

    def __post_init__(self) -> None:
        if self.row_tiles not in (1, 2, 4, 8):
            raise ValueError(f"row_tiles must be 1, 2, 4 or 8, got {self.row_tiles}")
        if self.block_m not in BLOCK_MS:
            raise ValueError(f"block_m must be one of {BLOCK_MS}, got {self.block_m}")
        planes = self.block_k // NIBBLES_PER_WORD  # a plane's K: a power of two >= 16
        if self.k_by_nibble and (self.block_k < 128 or planes & (planes - 1)):
            raise ValueError(f"k_by_nibble needs block_k a power of two >= 128, got {self.block_k}")

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
        k_by_nibble: bool = False,
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
            k_by_nibble=k_by_nibble,
        )


def matmul_config(n: int, k: int, group_size: int | None = None) -> MatmulConfig:
    """Launch parameters for an [N, K] weight: dense bf16 if `group_size` is None, else 4-bit.

    Depends on (N, K, kind) only, never on the row count: that is what makes rows independent.
    A configuration measured for the shape on the H200 (`tuned_configs`) wins. Otherwise:
    decode and verify are memory-bound (each row tile streams the whole weight once), so the
    aim is to keep every SM streaming: SPLIT_K is the smallest split (in whole BLOCK_K blocks)
    that gives at least 2 × 132 programs for one row tile, but every split keeps a loop of at
    least 2 blocks to pipeline. The extra traffic, fp32 partials [SPLIT_K, M, N] written and
    summed once, is small beside the weight for M <= 128. 4-bit tiles use a BLOCK_K dividing
    the group size, so one scale/zero row serves a tile.
    """
    tuned = tuned_configs().get(config_key(n, k, group_size))
    if tuned is not None:
        return MatmulConfig(**tuned)
    block_n = max(MIN_DOT_K, min(MAX_BLOCK_N, triton.next_power_of_2(n)))
    block_k = BLOCK_K if group_size is None else min(BLOCK_K, group_size & -group_size)
    num_tiles = triton.cdiv(n, block_n)
    num_blocks = triton.cdiv(k, block_k)
    wanted_splits, blocks_per_split = 1, num_blocks
    while (
        num_tiles * triton.cdiv(num_blocks, blocks_per_split) < MIN_PROGRAMS
        and blocks_per_split > MIN_BLOCKS_PER_SPLIT
    ):
        wanted_splits += 1
        blocks_per_split = max(MIN_BLOCKS_PER_SPLIT, triton.cdiv(num_blocks, wanted_splits))
    return MatmulConfig.over_splits(k, block_n, block_k, blocks_per_split)


def config_key(n: int, k: int, group_size: int | None) -> str:
    return f"dense:{n}x{k}" if group_size is None else f"int4:{n}x{k}:g{group_size}"


@functools.cache
def tuned_configs() -> dict[str, dict]:
    """Per-shape launch configs measured on an H200 (bench/tune_row_matmul.py), by
    `config_key`; shapes not listed use the heuristic of `matmul_config`."""
    if not TUNED_CONFIGS_PATH.exists():
        return {}
    return json.loads(TUNED_CONFIGS_PATH.read_text())["configs"]


@triton.jit
def _dot_acc(a, b, acc, DOT_IN_FP32: tl.constexpr):
    if DOT_IN_FP32:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


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
        acc = _dot_acc(w, x, acc, DOT_IN_FP32)
    else:
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
        x = tl.load(x_ptrs, mask=(offs_m[:, None] < M) & k_mask[None, :], other=0.0)
        acc = _dot_acc(x, w, acc, DOT_IN_FP32)
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
def _store_tile(
    out_ptr, acc, row0, offs_n, M, N, stride_os, stride_om,
    BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr, ROUND_ON_BITS: tl.constexpr,
    SWAP_AB: tl.constexpr,
):  # fmt: skip
    """bf16 into out, or fp32 into split `program_id(2)` of the partials [SPLIT_K, M, N]
    (SWAP_AB: acc is the tile transposed, [BLOCK_N, BLOCK_M])."""
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
    _store_tile(out_ptr, acc0, row0, offs_n, M, N, stride_os, stride_om,
                BLOCK_M, SPLIT_K, ROUND_ON_BITS, SWAP_AB)  # fmt: skip
    if ROW_TILES > 1:
        _store_tile(out_ptr, acc1, row0 + BLOCK_M, offs_n, M, N, stride_os, stride_om,
                    BLOCK_M, SPLIT_K, ROUND_ON_BITS, SWAP_AB)  # fmt: skip
    if ROW_TILES > 2:
        _store_tile(out_ptr, acc2, row0 + 2 * BLOCK_M, offs_n, M, N, stride_os, stride_om,
                    BLOCK_M, SPLIT_K, ROUND_ON_BITS, SWAP_AB)  # fmt: skip
        _store_tile(out_ptr, acc3, row0 + 3 * BLOCK_M, offs_n, M, N, stride_os, stride_om,
                    BLOCK_M, SPLIT_K, ROUND_ON_BITS, SWAP_AB)  # fmt: skip
    if ROW_TILES > 4:
        _store_tile(out_ptr, acc4, row0 + 4 * BLOCK_M, offs_n, M, N, stride_os, stride_om,
                    BLOCK_M, SPLIT_K, ROUND_ON_BITS, SWAP_AB)  # fmt: skip
        _store_tile(out_ptr, acc5, row0 + 5 * BLOCK_M, offs_n, M, N, stride_os, stride_om,
                    BLOCK_M, SPLIT_K, ROUND_ON_BITS, SWAP_AB)  # fmt: skip
        _store_tile(out_ptr, acc6, row0 + 6 * BLOCK_M, offs_n, M, N, stride_os, stride_om,
                    BLOCK_M, SPLIT_K, ROUND_ON_BITS, SWAP_AB)  # fmt: skip
        _store_tile(out_ptr, acc7, row0 + 7 * BLOCK_M, offs_n, M, N, stride_os, stride_om,
                    BLOCK_M, SPLIT_K, ROUND_ON_BITS, SWAP_AB)  # fmt: skip


@triton.jit
def _packed_tile(
    w_ptr, s_ptr, z_ptr, k0, offs_n, N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_SIZE: tl.constexpr, SWAP_AB: tl.constexpr,
):  # fmt: skip
    """A 4-bit K tile within one group, each word loaded once: the packed words
    [BLOCK_K / 8, BLOCK_N] (SWAP_AB: [BLOCK_N, BLOCK_K / 8]), the group's fp32 scales
    [BLOCK_N] and its zeros as 2^23 + z [BLOCK_N] (what `_magic_dequantize` subtracts)."""
    n_mask = offs_n < N
    offs_word = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    if SWAP_AB:
        words = tl.load(w_ptr + offs_word[None, :] * N + offs_n[:, None], mask=n_mask[:, None])
    else:
        words = tl.load(w_ptr + offs_word[:, None] * N + offs_n[None, :], mask=n_mask[None, :])
    group = k0 // GROUP_SIZE
    s = tl.load(s_ptr + group * N + offs_n, mask=n_mask, other=0.0)
    zero_magic = tl.load(z_ptr + group * N + offs_n, mask=n_mask, other=0).to(tl.float32)
    return words, s, zero_magic + 8388608.0


@triton.jit
def _magic_dequantize(nibbles, s, zero_magic):
    """(q - z) * s in fp32 for nibbles q (s and zero_magic = 2^23 + z broadcast to them).

    Without an int -> float conversion per weight (conversions are the slow unit): the
    nibble is OR-ed into the mantissa of 2^23, giving the float 2^23 + q exactly, and
    2^23 + z is subtracted, which is exact too.
    """
    magic = (nibbles | 0x4B000000).to(tl.float32, bitcast=True)
    return (magic - zero_magic) * s


@triton.jit
def _dequantize_words(
    words, s, zero_magic, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr
):
    """[BLOCK_K / 8, BLOCK_N] packed words -> the fp32 tile [BLOCK_K, BLOCK_N], (q - z) * s
    (SWAP_AB: words [BLOCK_N, BLOCK_K / 8] -> the tile [BLOCK_N, BLOCK_K]). Row 8j + i of
    the tile is nibble i of word row j, the order `RepackedInt4` stores."""
    if SWAP_AB:
        nibbles = (words[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF
        w = _magic_dequantize(nibbles, s[:, None, None], zero_magic[:, None, None])
        w = tl.reshape(w, (BLOCK_N, BLOCK_K))
    else:
        nibbles = (words[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF
        w = _magic_dequantize(nibbles, s[None, None, :], zero_magic[None, None, :])
        w = tl.reshape(w, (BLOCK_K, BLOCK_N))
    return w


@triton.jit
def _weight_tile(
    w_ptr, s_ptr, z_ptr, stride_wn, k0, offs_k, offs_n, N: tl.constexpr, K: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_SIZE: tl.constexpr,
    IS_INT4: tl.constexpr, ROUND_ON_BITS: tl.constexpr, SWAP_AB: tl.constexpr,
):  # fmt: skip
    """The bf16 tile W[offs_n, offs_k]ᵀ, [BLOCK_K, BLOCK_N] (SWAP_AB: W[offs_n, offs_k],
    [BLOCK_N, BLOCK_K]), zero outside the weight. 4-bit: within one group, from BLOCK_K / 8
    rows of packed words, each word loaded once."""
    n_mask = offs_n < N
    if IS_INT4:
        words, s, zero_magic = _packed_tile(
            w_ptr, s_ptr, z_ptr, k0, offs_n, N, BLOCK_K, GROUP_SIZE, SWAP_AB
        )
        w = _dequantize_words(words, s, zero_magic, BLOCK_K, BLOCK_N, SWAP_AB)
        w = round_to(w, tl.bfloat16, ROUND_ON_BITS)
    elif SWAP_AB:
        w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
        w = tl.load(w_ptrs, mask=(offs_k[None, :] < K) & n_mask[:, None], other=0.0)
    else:
        w_ptrs = w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None]
        w = tl.load(w_ptrs, mask=(offs_k[:, None] < K) & n_mask[None, :], other=0.0)
    return w


@triton.jit
def _nibble_planes_step(
    x_ptr, w_ptr, s_ptr, z_ptr, row0, M, stride_xm, k0, offs_n,
    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, N: tl.constexpr, K: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, ROW_TILES: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    ROUND_ON_BITS: tl.constexpr, SWAP_AB: tl.constexpr,
):  # fmt: skip
    """One 4-bit K tile as 8 nibble planes: plane i holds inputs k0 + 8j + i (nibble i of
    word row j), is dequantized elementwise where the words sit, (q - z) * s rounded to
    bf16 as in `_weight_tile`, and is summed into the row tiles by its own dot."""
    words, s, zero_magic = _packed_tile(
        w_ptr, s_ptr, z_ptr, k0, offs_n, N, BLOCK_K, GROUP_SIZE, SWAP_AB
    )
    if SWAP_AB:
        s, zero_magic = s[:, None], zero_magic[:, None]
    else:
        s, zero_magic = s[None, :], zero_magic[None, :]
    offs_j = tl.arange(0, BLOCK_K // 8)
    for i in tl.static_range(8):
        plane = _magic_dequantize((words >> (4 * i)) & 0xF, s, zero_magic)
        w = round_to(plane, tl.bfloat16, ROUND_ON_BITS)
        offs_k = k0 + 8 * offs_j + i
        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _tiles_step(
            x_ptr, row0, M, stride_xm, offs_k, offs_k < K, w,
            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, BLOCK_M, ROW_TILES, DOT_IN_FP32,
            SWAP_AB,
        )  # fmt: skip
    return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7


@triton.jit(do_not_specialize=["M", "stride_os"])
def _row_matmul_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, M, stride_xm, stride_wn, stride_os, stride_om,
    N: tl.constexpr, K: tl.constexpr, K_PER_SPLIT: tl.constexpr, GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROW_TILES: tl.constexpr,
    SPLIT_K: tl.constexpr, IS_INT4: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    ROUND_ON_BITS: tl.constexpr, SWAP_AB: tl.constexpr, K_BY_NIBBLE: tl.constexpr,
):  # fmt: skip
    """Program (i, j, s): row tiles i·ROW_TILES.., output columns j·BLOCK_N.., K split s.
    One weight tile per loop step (4-bit: GROUP_SIZE a multiple of BLOCK_K, so one scale
    and zero row serves a tile), used by each of the program's row tiles."""
    tl.static_assert(not IS_INT4 or (GROUP_SIZE % BLOCK_K == 0 and BLOCK_K % 8 == 0))
    row0 = tl.program_id(0) * (BLOCK_M * ROW_TILES)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = tl.program_id(2) * K_PER_SPLIT
    if SWAP_AB:
        acc0 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc1, acc2, acc3, acc4, acc5, acc6, acc7 = acc0, acc0, acc0, acc0, acc0, acc0, acc0
    for k0 in range(k_start, tl.minimum(k_start + K_PER_SPLIT, K), BLOCK_K):
        if K_BY_NIBBLE:
            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _nibble_planes_step(
                x_ptr, w_ptr, s_ptr, z_ptr, row0, M, stride_xm, k0, offs_n,
                acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, N, K, BLOCK_K, BLOCK_N,
                GROUP_SIZE, BLOCK_M, ROW_TILES, DOT_IN_FP32, ROUND_ON_BITS, SWAP_AB,
            )  # fmt: skip
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            w = _weight_tile(w_ptr, s_ptr, z_ptr, stride_wn, k0, offs_k, offs_n, N, K,
                             BLOCK_K, BLOCK_N, GROUP_SIZE, IS_INT4, ROUND_ON_BITS,
                             SWAP_AB)  # fmt: skip
            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _tiles_step(
                x_ptr, row0, M, stride_xm, offs_k, offs_k < K, w,
                acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, BLOCK_M, ROW_TILES, DOT_IN_FP32,
                SWAP_AB,
            )  # fmt: skip
    _store_tiles(out_ptr, row0, offs_n, M, N, stride_os, stride_om,
                 acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7,
                 BLOCK_M, ROW_TILES, SPLIT_K, ROUND_ON_BITS, SWAP_AB)  # fmt: skip


@triton.jit(do_not_specialize=["M"])
def _sum_splits_kernel(
    partial_ptr, out_ptr, M, stride_om,
    N: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, ROUND_ON_BITS: tl.constexpr,
):  # fmt: skip
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
            ROUND_ON_BITS=is_interpreting(), num_warps=4, enable_fp_fusion=FP_FUSION,
        )  # fmt: skip
    return out


def row_matmul(
    x: torch.Tensor,
    weight: torch.Tensor | RepackedInt4,
    out: torch.Tensor | None = None,
    config: MatmulConfig | None = None,
    keep_splits: bool = False,
) -> torch.Tensor | SplitSums:
    """`x @ weightᵀ` with fp32 accumulation and one rounding to bf16; rows are independent.

    x: bf16 [M, K] with unit last stride; weight: bf16 [N, K] with unit last stride, or a
    `RepackedInt4` of [N, K]; out: optional bf16 [M, N] with unit last stride. Returns out
    (or a new [M, N] tensor). Row m of the result is bit-identical for any M. No host
    synchronisation; the only allocation (split-K partials) depends on shapes alone.
    keep_splits: where the shape's configuration splits K, return the partial sums unsummed
    (`SplitSums`, for a consumer that adds them up itself; `out` is then not written).
    """
    n, k = _check_weight(weight, x)
    _check_x(x, k)
    m = x.shape[0]
    if keep_splits and out is not None:
        raise ValueError("keep_splits: the partial sums are the result, give no out")
    is_int4 = isinstance(weight, RepackedInt4)
    if config is None:  # (explicit configs: tuning and tests only, never per call site)
        config = matmul_config(n, k, weight.group_size if is_int4 else None)
    if config.k_by_nibble and not (is_int4 and weight.group_size % config.block_k == 0):
        raise ValueError("k_by_nibble needs a 4-bit weight whose group size block_k divides")
    if config.split_k > 1 and keep_splits and m:
        out = None
    elif out is None:
        out = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    else:
        _check_out(out, m, n, x.device)
    if m == 0:
        return out
    target = out
    if config.split_k > 1:
        target = torch.empty((config.split_k, m, n), dtype=torch.float32, device=x.device)
    stride_os, stride_om = (m * n, n) if config.split_k > 1 else (0, out.stride(0))
    rows_per_program = config.block_m * config.row_tiles
    grid = (triton.cdiv(m, rows_per_program), triton.cdiv(n, config.block_n), config.split_k)
    shape_args = {"N": n, "K": k, "K_PER_SPLIT": config.k_per_split, "BLOCK_M": config.block_m}
    shape_args |= {"ROW_TILES": config.row_tiles, "SWAP_AB": config.swap_ab}
    shape_args |= {"K_BY_NIBBLE": config.k_by_nibble}
    shape_args |= {"BLOCK_N": config.block_n, "BLOCK_K": config.block_k, "SPLIT_K": config.split_k}
    is_interpreted = is_interpreting()
    launch_args = {"DOT_IN_FP32": is_interpreted, "ROUND_ON_BITS": is_interpreted}
    launch_args |= {"num_warps": config.num_warps, "num_stages": config.num_stages}
    launch_args |= {"enable_fp_fusion": FP_FUSION}
    if is_int4:
        tensors = (weight.qweight, weight.scales, weight.zeros)
        stride_wn, group_size = 0, weight.group_size
    else:
        tensors, stride_wn, group_size = (weight, weight, weight), weight.stride(0), 0
    _row_matmul_kernel[grid](
        x, *tensors, target, m, x.stride(0), stride_wn, stride_os, stride_om,
        GROUP_SIZE=group_size, IS_INT4=is_int4, **shape_args, **launch_args,
    )  # fmt: skip
    if out is None:
        return SplitSums(target, (m, n))
    if config.split_k > 1:
        sum_splits(target, out)
    return out


def row_matmul_reference(x: torch.Tensor, weight: torch.Tensor | RepackedInt4) -> torch.Tensor:
    """fp32 [M, N]: `x.float() @ w.float()ᵀ`, w the bf16 weight (4-bit: dequantized to bf16)."""
    if isinstance(weight, RepackedInt4):
        weight = weight.dequantize(torch.bfloat16)
    return x.float() @ weight.float().t()


def _check_weight(weight: torch.Tensor | RepackedInt4, x: torch.Tensor) -> tuple[int, int]:
    if isinstance(weight, RepackedInt4):
        if weight.qweight.device != x.device:
            raise ValueError(f"weight must be on {x.device}, got {weight.qweight.device}")
        return weight.out_features, weight.in_features
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"weight must be a tensor or RepackedInt4, got {type(weight).__name__}")
    if weight.dim() != 2 or weight.dtype != torch.bfloat16 or weight.stride(-1) != 1:
        raise ValueError(f"weight must be bf16 [N, K] with unit last stride, got {weight.dtype} "
                         f"{tuple(weight.shape)} strides {weight.stride()}")  # fmt: skip
    if weight.device != x.device:
        raise ValueError(f"weight must be on {x.device}, got {weight.device}")
    return weight.shape[0], weight.shape[1]


def _check_x(x: torch.Tensor, k: int) -> None:
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}], got {tuple(x.shape)}")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"x must be bf16, got {x.dtype}")
    if x.stride(1) != 1:
        raise ValueError(f"x must have a unit last stride, got strides {x.stride()}")


def _check_out(out: torch.Tensor, m: int, n: int, device: torch.device) -> None:
    if out.shape != (m, n) or out.dtype != torch.bfloat16 or out.device != device:
        raise ValueError(f"out must be bf16 ({m}, {n}) on {device}, got {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")  # fmt: skip
    if out.stride(1) != 1:
        raise ValueError(f"out must have a unit last stride, got strides {out.stride()}")
