"""`y = x @ Wᵀ` for verify/decode rows with a 4-bit weight read packed (W4A16), row-independent.

Why a kernel of its own: the 4-bit tile `row_matmul` had until 2026-12-01 rebuilt every
weight as the fp32 `(q - z) * s` rounded to bf16, about six instructions a weight, and was
bound by them rather than by memory (ncu on the H200: 9 % of DRAM bandwidth). Here a weight
enters the tensor cores as the small integer q - z, exact in bf16, built two at a time from
its bits: the nibble is OR-ed into the mantissa of bf16 128.0 and one bf16x2 add of
-(128 + z) leaves q - z (1.5 instructions a weight, in `_planes`). Each group's scale then
multiplies the fp32 dot of its inputs. That is closer to the exact product than rounding
(q - z) * s to bf16 first, so the bits differ from `row_matmul`'s on the layer's bf16 copy
(both are checked against the fp32 product).

Layout (`PlanarInt4`, repacked once at load): K in tiles of TILE_K = 8 * PLANE_K inputs;
word row t * PLANE_K + j of column n holds in nibble i the input t * TILE_K + i * PLANE_K + j.
Nibble i of a tile's words is thus one contiguous slice of PLANE_K inputs (a "plane"), which
goes straight into the MMA (from registers) against the same slice of x, with no reshuffle
of the unpacked values.

Rows: a program computes `block_m` rows (the MMA's narrow side) for `block_n` outputs over
`tiles_per_split` tiles of K. The K split, which fixes the order of a row's fp32 sums, comes
from the weight's shape alone (`w4a16_config`), and split-K partials are summed in split
order (`sum_splits`), so a row's result does not depend on how many rows share the launch.
The tile sizes, warps and stages may follow the row count (`ROW_BUCKETS`: one verify block,
or more): they decide which program computes a row, not how. On the H200, with a shape's
split fixed, every block_n (64, 128) × block_m (16, 32, 64) × stages (2, 3) × warps (4, 8)
gave the same bits for each tuned shape (2026-12-04,
bench/results/w4a16-row-buckets-2026-12-04-nvidia-h200.json), and the GPU tests check the
shipped configurations: rows of a 128-row call equal those of 16-row and 1-row calls.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import triton
import triton.language as tl

from dflash_serve.checkpoint.int4_formats import NIBBLES_PER_WORD, PackedInt4Weight, unpack_int4
from dflash_serve.kernels import is_interpreting, launch_options
from dflash_serve.kernels.jit_math import dot_in, grouped_tile, store_row_tile, wait_for_inputs
from dflash_serve.kernels.row_matmul import WIDE_MIN_ROWS, RowOutput, WideLaunch, check_rows
from dflash_serve.layers.split_sums import SplitSums

PLANE_K = 32
TILE_K = NIBBLES_PER_WORD * PLANE_K
# The split launch's row tiles (bench.tune_w4a16 sweeps them). Larger tiles (block_m 128,
# block_n up to 256, 8 warps) were swept for more than 16 rows too (H100, 2026-12-08, each
# shape's split kept): the same bits; none faster at 128 rows, and at 32 or 64 rows faster only
# for down at 64 (best: block_n 128, 8 warps, 20.3 against 23.4 us). Results:
# bench/results/w4a16-rows128-and-verify-copies-2026-12-08-nvidia-h100.json
BLOCK_MS = (16, 32, 64)
ANY_BLOCK_M = (*BLOCK_MS, 128)  # 128: the wide launch's (WIDE_LAUNCH)
NUM_SMS = 132  # H200; a constant, so the config never depends on the machine either
MIN_PROGRAMS = 2 * NUM_SMS
MIN_TILES_PER_SPLIT = 2
# Row counts a tuned shape has a launch for: up to one verify block, and anything more.
ROW_BUCKETS = (16, None)
LAUNCH_FIELDS = ("block_n", "block_m", "num_warps", "num_stages")
# How calls of at least WIDE_MIN_ROWS rows (prefill) are tiled: of the tiles tried on an H100
# (2026-12-05, bench/results/prefill-wide-launch-2026-12-05-nvidia-h100.json) the fastest
# for gate+up and down at 512-2048 rows, all with the split launch's bits.
WIDE_LAUNCH = WideLaunch(block_m=128, block_n=128, num_warps=8, num_stages=3)
TUNED_CONFIGS_PATH = Path(__file__).with_name("w4a16_configs.json")


@dataclass(frozen=True, eq=False)
class PlanarInt4:
    """A 4-bit weight [N, K] in the layout `w4a16_matmul` reads (see the module docstring).

    words: int32 [K_pad / 8, N], K_pad = K rounded up to whole tiles (padding holds zeros);
    scales: fp32 [G_pad, N] (exact copies of the stored ones) and zeros: uint8 [G_pad, N],
    G_pad groups covering K_pad (padding: scale 0). W[n, k] = (q - z) * s.
    """

    words: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    out_features: int
    in_features: int
    group_size: int

    @property
    def num_tiles(self) -> int:
        return self.words.shape[0] // PLANE_K

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [N, K]: (q - z) * s exact in fp32, then one cast to `dtype`."""
        shifts = 4 * torch.arange(NIBBLES_PER_WORD, device=self.words.device)
        words = self.words.to(torch.int64).reshape(self.num_tiles, 1, PLANE_K, -1)
        q = (words >> shifts[None, :, None, None]) & 0xF  # [tiles, nibble, j, N]
        q = q.reshape(self.num_tiles * TILE_K, -1)[: self.in_features]
        zeros = self.zeros.to(torch.int64).repeat_interleave(self.group_size, dim=0)
        scales = self.scales.repeat_interleave(self.group_size, dim=0)
        k = self.in_features
        return ((q - zeros[:k]).float() * scales[:k]).t().contiguous().to(dtype)


def repack_planar(packed: PackedInt4Weight) -> PlanarInt4:
    """AWQ GEMM or compressed-tensors -> `PlanarInt4`, on the packed tensors' device (once, at
    load). The group size must divide a tile (32, 64, 128 or 256 inputs) or be a multiple of
    one (real checkpoints use 32..128)."""
    n, k, group_size = packed.out_features, packed.in_features, packed.group_size
    if group_size % PLANE_K or (TILE_K % group_size and group_size % TILE_K):
        raise ValueError(
            f"packed: group_size must be a multiple of {PLANE_K} that divides {TILE_K} or is "
            f"a multiple of it, got {group_size}"
        )
    q, zeros, scales = unpack_int4(packed)  # [K, N], [K/g, N], [K/g, N]
    num_tiles = triton.cdiv(k, TILE_K)
    q = torch.nn.functional.pad(q, (0, 0, 0, num_tiles * TILE_K - k))
    q = q.reshape(num_tiles, NIBBLES_PER_WORD, PLANE_K, n)
    shifts = 4 * torch.arange(NIBBLES_PER_WORD, device=q.device, dtype=torch.int64)
    words = (q << shifts[None, :, None, None]).sum(1).reshape(num_tiles * PLANE_K, n)
    words = torch.where(words >= 2**31, words - 2**32, words)  # the top nibble's bits
    num_groups = triton.cdiv(num_tiles * TILE_K, group_size)
    padding = (0, 0, 0, num_groups - zeros.shape[0])
    return PlanarInt4(
        words=words.to(torch.int32).contiguous(),
        scales=torch.nn.functional.pad(scales.float(), padding).contiguous(),
        zeros=torch.nn.functional.pad(zeros, padding).to(torch.uint8).contiguous(),
        out_features=n,
        in_features=k,
        group_size=group_size,
    )


def concat_planar(weights: list[PlanarInt4]) -> PlanarInt4:
    """Weights of one input (same K and group size) stacked along N: one matmul for all."""
    first = weights[0]
    if any((w.in_features, w.group_size) != (first.in_features, first.group_size) for w in weights):
        raise ValueError("weights: stacking needs one in_features and group_size for all")
    return PlanarInt4(
        words=torch.cat([w.words for w in weights], dim=1).contiguous(),
        scales=torch.cat([w.scales for w in weights], dim=1).contiguous(),
        zeros=torch.cat([w.zeros for w in weights], dim=1).contiguous(),
        out_features=sum(w.out_features for w in weights),
        in_features=first.in_features,
        group_size=first.group_size,
    )


@dataclass(frozen=True)
class W4A16Config:
    """One launch: programs of block_n outputs × block_m rows over tiles_per_split tiles of
    K (split_k splits, the last may be shorter)."""

    block_n: int
    block_m: int
    tiles_per_split: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        if self.block_m not in ANY_BLOCK_M:
            raise ValueError(f"block_m must be one of {ANY_BLOCK_M}, got {self.block_m}")

    @classmethod
    def over_splits(cls, num_tiles: int, tiles_per_split: int, **launch: int) -> W4A16Config:
        """K's `num_tiles` tiles cut into splits of `tiles_per_split` (the last shorter)."""
        split_k = triton.cdiv(num_tiles, tiles_per_split)
        return cls(tiles_per_split=tiles_per_split, split_k=split_k, **launch)


def w4a16_config(n: int, k: int, group_size: int, rows: int) -> W4A16Config:
    """Launch parameters for `rows` rows of a 4-bit [N, K] weight: the K split from the shape
    alone, the tiles, warps and stages for the row count's bucket (see the module docstring).

    A configuration measured for the shape on the H200 (`tuned_configs`) wins. Otherwise:
    verify and decode stream the whole weight once per row tile, so the aim is every SM
    streaming: K is split until one row tile has at least 2 × 132 programs, keeping at
    least two tiles per split to pipeline (the same launch for every row count)."""
    launches = tuned_launches().get(config_key(n, k, group_size))
    if launches is not None:
        return launches[row_bucket(rows)]
    block_n = 128 if n >= 2048 else 64
    return split_over_programs(n, k, MIN_PROGRAMS, block_n=block_n, block_m=16)


def row_bucket(rows: int) -> int:
    """The index in `ROW_BUCKETS` (and in a tuned shape's launches) for `rows` rows."""
    return next(i for i, most in enumerate(ROW_BUCKETS) if most is None or rows <= most)


def split_over_programs(n: int, k: int, min_programs: int, **launch: int) -> W4A16Config:
    """`launch` (block_n, …) with K split into the fewest splits that give one row tile at
    least `min_programs` programs, each split keeping at least two tiles to pipeline."""
    num_tiles = triton.cdiv(k, TILE_K)
    num_columns = triton.cdiv(n, launch["block_n"])
    tiles_per_split = num_tiles
    while (
        num_columns * triton.cdiv(num_tiles, tiles_per_split) < min_programs
        and tiles_per_split > MIN_TILES_PER_SPLIT
    ):
        tiles_per_split -= 1
    return W4A16Config.over_splits(num_tiles, tiles_per_split, **launch)


def _planes_ptx() -> str:
    """`_planes`' PTX: operands $0-$7 the planes' bf16x2 pairs, $8, $9 the two words, $10-$17
    the planes' zeros. lo / hi hold the two words' low / high halves side by side."""
    lines = [
        ".reg .b32 lo, hi, t, one;",
        "mov.b32 one, 0x3F803F80;",  # bf16x2 (1.0, 1.0)
        "prmt.b32 lo, $8, $9, 0x5410;",
        "prmt.b32 hi, $8, $9, 0x7632;",
    ]
    for plane in range(NIBBLES_PER_WORD):
        half, shift = ("lo", "hi")[plane // 4], 4 * (plane % 4)
        if shift:
            lines.append(f"shr.u32 t, {half}, {shift};")
        # (w & 0x000F000F) | 0x43004300: bf16x2 (128 + q_a, 128 + q_b); then + (-(128 + z))
        lines.append(f"lop3.b32 t, {'t' if shift else half}, 0x000F000F, 0x43004300, 0xEA;")
        lines.append(f"fma.rn.bf16x2 ${plane}, t, one, ${10 + plane};")
    return "{\n" + "\n".join(lines) + "\n}"


PLANES_PTX = tl.constexpr(_planes_ptx())


def config_key(n: int, k: int, group_size: int) -> str:
    return f"{n}x{k}:g{group_size}"


@functools.cache
def tuned_configs() -> dict[str, dict]:
    """Per-shape launch configs measured on an H200 (bench/tune_w4a16.py; three shapes' K
    splits on an H100, see the file's note), by `config_key`:
    {tiles_per_split, split_k, by_rows: one launch (LAUNCH_FIELDS) per `ROW_BUCKETS` entry,
    as max_rows}; shapes not listed use the heuristic of `w4a16_config`."""
    if not TUNED_CONFIGS_PATH.exists():
        return {}
    configs = json.loads(TUNED_CONFIGS_PATH.read_text())["configs"]
    for key, tuned in configs.items():
        buckets = tuple(launch.get("max_rows") for launch in tuned.get("by_rows", ()))
        if buckets != ROW_BUCKETS or not {"tiles_per_split", "split_k"} <= tuned.keys():
            raise ValueError(
                f"{TUNED_CONFIGS_PATH.name}: {key} needs tiles_per_split, split_k and by_rows "
                f"for max_rows {ROW_BUCKETS}, got {tuned}"
            )
    return configs


@functools.cache
def tuned_launches() -> dict[str, list[W4A16Config]]:
    """Every tuned shape's launches, one per row bucket (for compiling and checking them)."""
    return {key: [_launch(tuned, bucket) for bucket in tuned["by_rows"]]
            for key, tuned in tuned_configs().items()}  # fmt: skip


def _launch(tuned: dict, bucket: dict) -> W4A16Config:
    fields = {name: bucket[name] for name in LAUNCH_FIELDS}
    return W4A16Config(tiles_per_split=tuned["tiles_per_split"], split_k=tuned["split_k"],
                       **fields)  # fmt: skip


@triton.jit
def _plane(words, i: tl.constexpr, zero):
    """Plane i of the words as `_planes` computes it, in plain Triton (the interpreter's)."""
    return (((words >> (4 * i)) & 0xF).to(tl.float32) + 128.0 + zero.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _planes(words, zero_0, zero_1, zero_2, zero_3, zero_4, zero_5, zero_6, zero_7,
            INTERPRETED: tl.constexpr):  # fmt: skip
    """int32 words [R, C] -> the 8 nibble planes as bf16 [R, C], plane i = q_i - z_i exactly,
    given zero_i = -(128 + z_i) in bf16 (broadcast to [R, C]).

    On the GPU two words at a time (pack=2): `prmt` gathers the two words' low (high)
    halves into one register, and for each nibble a shift, one `lop3` ((w & 0x000F000F) |
    0x43004300: two bf16 of 128 + q) and one bf16x2 add of the zeros give two weights.
    """
    if INTERPRETED:
        return (
            _plane(words, 0, zero_0), _plane(words, 1, zero_1), _plane(words, 2, zero_2),
            _plane(words, 3, zero_3), _plane(words, 4, zero_4), _plane(words, 5, zero_5),
            _plane(words, 6, zero_6), _plane(words, 7, zero_7),
        )  # fmt: skip
    return tl.inline_asm_elementwise(
        PLANES_PTX,
        "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r",
        [words, zero_0, zero_1, zero_2, zero_3, zero_4, zero_5, zero_6, zero_7],
        dtype=(tl.bfloat16,) * 8,
        is_pure=True,
        pack=2,
    )


@triton.jit
def _group_zero(z_ptr, k, offs_n, n_mask, N: tl.constexpr, GROUP_SIZE: tl.constexpr):
    """-(128 + z) in bf16 [BLOCK_N, 1] for the group holding input k (what `_planes` adds)."""
    z = tl.load(z_ptr + (k // GROUP_SIZE) * N + offs_n, mask=n_mask, other=0)
    return (-128.0 - z.to(tl.float32)).to(tl.bfloat16)[:, None]


@triton.jit
def _tile_planes(
    words, z_ptr, k0, offs_n, n_mask, N: tl.constexpr, GROUP_SIZE: tl.constexpr,
    PLANE_K: tl.constexpr, PLANES_PER_GROUP: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """A tile's 8 planes, each group's zeros loaded once (1, 2, 4 or 8 groups a tile)."""
    z0 = _group_zero(z_ptr, k0, offs_n, n_mask, N, GROUP_SIZE)
    if PLANES_PER_GROUP == 8:
        return _planes(words, z0, z0, z0, z0, z0, z0, z0, z0, INTERPRETED)
    z4 = _group_zero(z_ptr, k0 + 4 * PLANE_K, offs_n, n_mask, N, GROUP_SIZE)
    if PLANES_PER_GROUP == 4:
        return _planes(words, z0, z0, z0, z0, z4, z4, z4, z4, INTERPRETED)
    z2 = _group_zero(z_ptr, k0 + 2 * PLANE_K, offs_n, n_mask, N, GROUP_SIZE)
    z6 = _group_zero(z_ptr, k0 + 6 * PLANE_K, offs_n, n_mask, N, GROUP_SIZE)
    if PLANES_PER_GROUP == 2:
        return _planes(words, z0, z0, z2, z2, z4, z4, z6, z6, INTERPRETED)
    z1 = _group_zero(z_ptr, k0 + PLANE_K, offs_n, n_mask, N, GROUP_SIZE)
    z3 = _group_zero(z_ptr, k0 + 3 * PLANE_K, offs_n, n_mask, N, GROUP_SIZE)
    z5 = _group_zero(z_ptr, k0 + 5 * PLANE_K, offs_n, n_mask, N, GROUP_SIZE)
    z7 = _group_zero(z_ptr, k0 + 7 * PLANE_K, offs_n, n_mask, N, GROUP_SIZE)
    return _planes(words, z0, z1, z2, z3, z4, z5, z6, z7, INTERPRETED)


@triton.jit
def _group_scale(s_ptr, k, offs_n, n_mask, N: tl.constexpr, GROUP_SIZE: tl.constexpr):
    """The scales [BLOCK_N] of the group holding input k."""
    return tl.load(s_ptr + (k // GROUP_SIZE) * N + offs_n, mask=n_mask, other=0.0)


@triton.jit
def _tile_scales(
    s_ptr, tile, offs_n, n_mask, N: tl.constexpr, GROUP_SIZE: tl.constexpr,
    PLANE_K: tl.constexpr, PLANES_PER_GROUP: tl.constexpr,
):  # fmt: skip
    """The scales of a tile's groups (1, 2, 4 or 8), one [BLOCK_N] vector each, in order.

    Loaded a tile ahead of their use (see `_w4a16_kernel`): they are needed only after the
    tile's dots, and a load issued there was the step's last wait on memory."""
    k0 = tile * (8 * PLANE_K)
    s0 = _group_scale(s_ptr, k0, offs_n, n_mask, N, GROUP_SIZE)
    if PLANES_PER_GROUP == 8:
        scales = (s0,)
    else:
        s4 = _group_scale(s_ptr, k0 + 4 * PLANE_K, offs_n, n_mask, N, GROUP_SIZE)
        if PLANES_PER_GROUP == 4:
            scales = (s0, s4)
        else:
            s2 = _group_scale(s_ptr, k0 + 2 * PLANE_K, offs_n, n_mask, N, GROUP_SIZE)
            s6 = _group_scale(s_ptr, k0 + 6 * PLANE_K, offs_n, n_mask, N, GROUP_SIZE)
            if PLANES_PER_GROUP == 2:
                scales = (s0, s2, s4, s6)
            else:
                scales = (
                    s0, _group_scale(s_ptr, k0 + PLANE_K, offs_n, n_mask, N, GROUP_SIZE),
                    s2, _group_scale(s_ptr, k0 + 3 * PLANE_K, offs_n, n_mask, N, GROUP_SIZE),
                    s4, _group_scale(s_ptr, k0 + 5 * PLANE_K, offs_n, n_mask, N, GROUP_SIZE),
                    s6, _group_scale(s_ptr, k0 + 7 * PLANE_K, offs_n, n_mask, N, GROUP_SIZE),
                )  # fmt: skip
    return scales


@triton.jit
def _tile_step(
    x_ptr, w_ptr, z_ptr, tile, scales, rows, row_mask, stride_xm, offs_n, n_mask, acc,
    N: tl.constexpr, K: tl.constexpr, GROUP_SIZE: tl.constexpr, PLANE_K: tl.constexpr,
    PLANES_PER_GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    RAGGED_K: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """acc [BLOCK_N, BLOCK_M] plus one tile's 8 * PLANE_K inputs: each plane's dot against
    its slice of x, summed per group in fp32 and then scaled by the group's `scales`.

    One dot per plane: joining a group's planes into one wider dot (one MMA wait instead of
    several) measured slower on the H200 (gate+up at 16 rows 24.8 against 18.3 µs)."""
    k0 = tile * (8 * PLANE_K)
    offs_j = tl.arange(0, PLANE_K)
    words = tl.load(w_ptr + (tile * PLANE_K + offs_j)[None, :] * N + offs_n[:, None],
                    mask=n_mask[:, None], other=0)  # fmt: skip
    planes = _tile_planes(words, z_ptr, k0, offs_n, n_mask, N, GROUP_SIZE, PLANE_K,
                          PLANES_PER_GROUP, INTERPRETED)  # fmt: skip
    partial = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for i in tl.static_range(8):
        offs_k = k0 + i * PLANE_K + offs_j
        x_mask = row_mask[None, :]
        if RAGGED_K:  # K ends inside the last tile: its padded weights meet zeros of x
            x_mask = x_mask & (offs_k[:, None] < K)
        x_tile = tl.load(x_ptr + rows[None, :] * stride_xm + offs_k[:, None], mask=x_mask,
                         other=0.0)  # fmt: skip
        partial = dot_in(planes[i], x_tile, partial, INTERPRETED)
        if (i + 1) % PLANES_PER_GROUP == 0:
            acc += partial * scales[i // PLANES_PER_GROUP][:, None]
            partial = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    return acc


@triton.jit(do_not_specialize=["M", "stride_os"])
def _w4a16_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, M, stride_xm, stride_os, stride_om,
    N: tl.constexpr, K: tl.constexpr, GROUP_SIZE: tl.constexpr, PLANE_K: tl.constexpr,
    PLANES_PER_GROUP: tl.constexpr, RAGGED_K: tl.constexpr, NUM_TILES: tl.constexpr,
    TILES_PER_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr, SPLITS_IN_PROGRAM: tl.constexpr, GROUP_M: tl.constexpr,
    INTERPRETED: tl.constexpr,
):  # fmt: skip
    """Program (j, i, s): outputs j·BLOCK_N.., rows i·BLOCK_M.., K split s; acc holds the
    tile transposed, [BLOCK_N, BLOCK_M] (the weight on the MMA's tall side).
    SPLITS_IN_PROGRAM (the wide launch, one program per output tile of a one-dimensional grid,
    `grouped_tile`): the program walks every split, each summed from zero and added to the
    total in split order as it ends (the order of `summed_splits`), and stores the bf16
    result."""
    wait_for_inputs()
    if SPLITS_IN_PROGRAM:
        row_tile, col_tile = grouped_tile(tl.program_id(0), M, BLOCK_M,
                                          (N + BLOCK_N - 1) // BLOCK_N, GROUP_M)  # fmt: skip
    else:
        row_tile, col_tile = tl.program_id(1), tl.program_id(0)
    offs_n = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    row0 = row_tile * BLOCK_M
    rows = row0 + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    if SPLITS_IN_PROGRAM:
        first = 0
        last = NUM_TILES - 1
    else:
        first = tl.program_id(2) * TILES_PER_SPLIT
        last = tl.minimum(first + TILES_PER_SPLIT, NUM_TILES) - 1
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    scales = _tile_scales(s_ptr, first, offs_n, n_mask, N, GROUP_SIZE, PLANE_K,
                          PLANES_PER_GROUP)  # fmt: skip
    for tile in range(first, last + 1):
        upcoming = _tile_scales(s_ptr, tl.minimum(tile + 1, last), offs_n, n_mask, N,
                                GROUP_SIZE, PLANE_K, PLANES_PER_GROUP)  # fmt: skip
        acc = _tile_step(x_ptr, w_ptr, z_ptr, tile, scales, rows, row_mask, stride_xm, offs_n,
                         n_mask, acc, N, K, GROUP_SIZE, PLANE_K, PLANES_PER_GROUP, BLOCK_N,
                         BLOCK_M, RAGGED_K, INTERPRETED)  # fmt: skip
        scales = upcoming
        if SPLITS_IN_PROGRAM:  # noqa: SIM102 (a compile-time branch around a run-time one)
            if ((tile + 1) % TILES_PER_SPLIT == 0) | (tile == last):
                # split 0's sum as it is (0 + p0 would turn a -0.0 into +0.0), then p0 + p1 …
                total = tl.where(tile < TILES_PER_SPLIT, acc, total + acc)
                acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if SPLITS_IN_PROGRAM:
        store_row_tile(out_ptr, total, row0, offs_n, M, N, 0, stride_om, BLOCK_M, 1,
                       INTERPRETED, True)  # fmt: skip
    else:
        store_row_tile(out_ptr, acc, row0, offs_n, M, N, stride_os, stride_om, BLOCK_M,
                       SPLIT_K, INTERPRETED, True)  # fmt: skip


def w4a16_matmul(
    x: torch.Tensor,
    weight: PlanarInt4,
    out: torch.Tensor | None = None,
    config: W4A16Config | None = None,
    keep_splits: bool = False,
    wide: WideLaunch | None = WIDE_LAUNCH,
) -> torch.Tensor | SplitSums:
    """`x @ Wᵀ` for a 4-bit W with fp32 accumulation and one rounding to bf16; rows are
    independent.

    x: bf16 [M, K] with unit last stride; out: optional bf16 [M, N] with unit last stride.
    Returns out (or a new tensor); row m is bit-identical for any M. No host
    synchronisation; the only allocation (split-K partials) depends on shapes alone.
    keep_splits: where K is split, return the partial sums unsummed (`SplitSums`, for a
    consumer that adds them in split order itself; `out` is then not written).
    wide: how calls of at least WIDE_MIN_ROWS rows are tiled (config's K split summed inside
    each program; the bf16 result even with keep_splits, as for `row_matmul`); None: every
    call through the split launch.
    """
    n, k = _check(x, weight)
    m = x.shape[0]
    if config is None:  # (explicit configs: tuning and tests only, never per call site)
        config = w4a16_config(n, k, weight.group_size, m)
    is_wide = wide is not None and m >= WIDE_MIN_ROWS
    target = RowOutput.for_call(x, n, 1 if is_wide else config.split_k, out, keep_splits)
    if m == 0:
        return target.result()
    stride_os, stride_om = target.strides
    if is_wide:
        tiles = {"block_n": wide.block_n, "block_m": wide.block_m}
        config = replace(config, **tiles, num_warps=wide.num_warps, num_stages=wide.num_stages)
        grid = (triton.cdiv(n, config.block_n) * triton.cdiv(m, config.block_m),)
    else:
        grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, config.block_m), config.split_k)
    _w4a16_kernel[grid](
        x, weight.words, weight.scales, weight.zeros, target.written, m, x.stride(0), stride_os,
        stride_om, N=n, K=k, GROUP_SIZE=weight.group_size, PLANE_K=PLANE_K,
        PLANES_PER_GROUP=min(NIBBLES_PER_WORD, weight.group_size // PLANE_K),
        RAGGED_K=k % TILE_K != 0, NUM_TILES=weight.num_tiles,
        TILES_PER_SPLIT=config.tiles_per_split, SPLIT_K=config.split_k,
        BLOCK_N=config.block_n, BLOCK_M=config.block_m, SPLITS_IN_PROGRAM=is_wide,
        GROUP_M=wide.group_m if is_wide else 1, INTERPRETED=is_interpreting(),
        num_warps=config.num_warps, num_stages=config.num_stages, **launch_options(),
    )  # fmt: skip
    return target.result()


def w4a16_reference(x: torch.Tensor, weight: PlanarInt4) -> torch.Tensor:
    """fp32 [M, N]: `x.float() @ Wᵀ` with W dequantized exactly in fp32."""
    return x.float() @ weight.dequantize(torch.float32).t()


def _check(x: torch.Tensor, weight: PlanarInt4) -> tuple[int, int]:
    if not isinstance(weight, PlanarInt4):
        raise ValueError(f"weight must be a PlanarInt4, got {type(weight).__name__}")
    if weight.words.device != x.device:
        raise ValueError(f"weight must be on {x.device}, got {weight.words.device}")
    check_rows(x, weight.in_features)
    return weight.out_features, weight.in_features
