"""w4a16_matmul against the fp32 product with the exactly dequantized weight, and row
independence bit for bit.

Tolerance: the kernel sums exact products (bf16 x times the integer q - z) in fp32 per group,
scales each group's sum in fp32 and rounds once to bf16, a relative error of at most 2^-8;
its fp32 summation order differs from torch's, which costs far less than 2^-10 of the output
scale at these K. So |y - ref| <= 2^-8·|ref| + 2^-10·max|ref|, ref the fp32 product of the
bf16 input and the fp32 weight (`w4a16_reference`). Where the product is exact (one-hot
rows: each output is one (q - z) * s, exact in fp32) and for row independence the comparison
is bit for bit; one-hot rows pin down every nibble's place in the layout.
"""

import dataclasses

import pytest
import torch

from dflash_serve.checkpoint.int4_formats import (
    AWQ_GEMM,
    COMPRESSED_TENSORS,
    PackedInt4Weight,
    pack_awq_gemm,
    pack_compressed_tensors,
)
from dflash_serve.kernels.row_matmul import WIDE_MIN_ROWS, WideLaunch
from dflash_serve.kernels.w4a16_matmul import (
    TILE_K,
    W4A16Config,
    concat_planar,
    repack_planar,
    tuned_launches,
    w4a16_config,
    w4a16_matmul,
    w4a16_reference,
)
from dflash_serve.layers.split_sums import SplitSums
from tests.matmul_cases import (
    DEVICE,
    assert_close_to_fp32,
    assert_wide_launch_gives_split_bits,
    random_rows,
    random_weight,
)

KINDS = ["awq", "ct_symmetric", "ct_asymmetric"]
# (N, K, group): several groups per tile of 256 inputs (32, 64, 128: the zeros differ between
# planes of a word, one dot per group), a group per tile (256) and per two tiles (512), ragged
# N (40, 24), K not a whole number of tiles (320, 384, 640: padded).
SHAPES = [
    (48, 256, 32),
    (40, 320, 64),
    (80, 512, 128),
    (64, 512, 256),
    (40, 1024, 512),
    (24, 384, 32),
    (40, 640, 128),
]
QWEN35_4B_SHAPES = {
    "gate_up": (18432, 2560),
    "down": (2560, 9216),
    "gdn_in": (12352, 2560),
    "attention_qkv": (10240, 2560),
    "out_proj": (2560, 4096),
}
QWEN35_GROUP = 128


def packed_weight(kind: str, n: int, k: int, group_size: int, seed: int = 0) -> PackedInt4Weight:
    weight = random_weight(n, k, seed)
    if kind == "awq":
        return PackedInt4Weight(AWQ_GEMM, n, k, group_size, pack_awq_gemm(weight, group_size))
    tensors = pack_compressed_tensors(weight, group_size, kind == "ct_symmetric")
    return PackedInt4Weight(COMPRESSED_TENSORS, n, k, group_size, tensors)


def planar_case(kind: str, shape, seed: int = 0):
    """(weight, its packed source, its config)."""
    n, k, group_size = shape
    packed = packed_weight(kind, n, k, group_size, seed)
    return repack_planar(packed), packed, w4a16_config(n, k, group_size, rows=37)


def assert_close_to_reference(y: torch.Tensor, x: torch.Tensor, weight) -> None:
    assert_close_to_fp32(y, w4a16_reference(x, weight))


def test_shapes_cover_splits_and_groups():
    configs = [planar_case("awq", shape)[2] for shape in SHAPES]
    assert {config.split_k > 1 for config in configs} == {False, True}
    assert {shape[2] < TILE_K for shape in SHAPES} == {False, True}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_repack_dequantizes_like_packed(kind, shape):
    weight, packed, _ = planar_case(kind, shape)
    assert torch.equal(weight.dequantize(torch.float32), packed.dequantize(torch.float32))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference(kind, shape):
    weight, _, config = planar_case(kind, shape)
    x = random_rows(37, shape[1], seed=1)
    assert_close_to_reference(w4a16_matmul(x, weight, config=config), x, weight)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[1], SHAPES[3], SHAPES[5]])
def test_one_hot_rows_pick_weight_columns(kind, shape):
    """x = I gives y[k, n] = bf16((q - z) * s) exactly: every nibble in its place."""
    weight, packed, config = planar_case(kind, shape)
    k = shape[1]
    step = max(1, k // 96)  # every plane of several tiles, groups and splits
    eye = torch.eye(k, device=DEVICE, dtype=torch.bfloat16)[::step]
    expected = packed.dequantize(torch.bfloat16).t()[::step]
    assert torch.equal(w4a16_matmul(eye, weight, config=config), expected)


def assert_rows_independent(x: torch.Tensor, weight, config: W4A16Config) -> None:
    """Rows of a 37-row call equal the same rows computed in other launches."""
    assert x.shape[0] == 37
    y37 = w4a16_matmul(x, weight, config=config)
    for rows in (slice(0, 1), slice(0, 5), slice(0, 16), slice(5, 37), slice(36, 37)):
        assert torch.equal(w4a16_matmul(x[rows], weight, config=config), y37[rows]), rows


@pytest.mark.parametrize("kind", ["awq", "ct_asymmetric"])
@pytest.mark.parametrize("block_n", [32, 64])  # 32: mma.sync on the GPU, 64: wgmma
@pytest.mark.parametrize("block_m", [16, 32, 64])
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[6]])
def test_rows_independent(kind, block_n, block_m, shape):
    weight, _, config = planar_case(kind, shape)
    config = dataclasses.replace(config, block_n=block_n, block_m=block_m)
    x = random_rows(37, shape[1], seed=2)
    assert_close_to_reference(w4a16_matmul(x, weight, config=config), x, weight)
    assert_rows_independent(x, weight, config)


@pytest.mark.parametrize("tiles_per_split", [1, 2, 3])
def test_splits_change_no_row_of_another_launch(tiles_per_split):
    """Any split of K (a short last one included) keeps rows independent and the product."""
    weight, _, config = planar_case("awq", (40, 1280, 64))
    config = W4A16Config.over_splits(weight.num_tiles, tiles_per_split, block_n=config.block_n,
                                     block_m=16)  # fmt: skip
    x = random_rows(37, 1280, seed=3)
    assert_close_to_reference(w4a16_matmul(x, weight, config=config), x, weight)
    assert_rows_independent(x, weight, config)


@pytest.mark.parametrize("shape", [(40, 1280, 64), SHAPES[6]])
def test_kept_splits_sum_to_the_result(shape):
    weight, _, config = planar_case("awq", shape)
    x = random_rows(21, shape[1], seed=4)
    expected = w4a16_matmul(x, weight, config=config)
    kept = w4a16_matmul(x, weight, config=config, keep_splits=True)
    assert config.split_k > 1
    assert isinstance(kept, SplitSums) and kept.partials.shape == (config.split_k, 21, shape[0])
    assert torch.equal(kept.total(), expected)


@pytest.mark.parametrize("shape", [(40, 1280, 64), SHAPES[0], SHAPES[6]])
def test_wide_launch_gives_the_split_launch_bits(shape):
    """Many rows (prefill) take the wide launch: one program per output tile walking every
    split, summed in split order, in groups of row tiles; ragged rows, columns and K. Tiles
    of the split launch's shape (under the interpreter a dot's order may follow its shape;
    the GPU test below checks the shipped tiles)."""
    weight, _, config = planar_case("awq", shape)
    config = dataclasses.replace(config, block_m=64)
    wide = WideLaunch(block_m=64, block_n=config.block_n, group_m=3)
    x = random_rows(WIDE_MIN_ROWS + 45, shape[1], seed=12)
    y = assert_wide_launch_gives_split_bits(w4a16_matmul, x, weight, config, wide)
    assert_close_to_reference(y, x, weight)


def test_wide_launch_adds_splits_in_order():
    """Splits 0 and 1 cancel exactly (weights W and -W: every nibble q and zero z flipped to
    15 - q, 15 - z, against equal inputs of 2^20) and split 2 is what is left: only sums that
    restart at each split and join the total in order keep split 2's bits."""
    n, group_size = 40, 64
    config = W4A16Config.over_splits(3, 1, block_n=32, block_m=64)
    wide = WideLaunch(block_m=64, block_n=32, group_m=2)
    part = repack_planar(packed_weight("awq", n, TILE_K, group_size, seed=13))
    small = repack_planar(packed_weight("awq", n, TILE_K, group_size, seed=14))
    negated = dataclasses.replace(part, words=~part.words, zeros=15 - part.zeros)
    thirds = (part, negated, small)
    weight = dataclasses.replace(
        part,
        words=torch.cat([third.words for third in thirds]),
        scales=torch.cat([third.scales for third in thirds]),
        zeros=torch.cat([third.zeros for third in thirds]),
        in_features=3 * TILE_K,
    )
    dense = [third.dequantize(torch.float32) for third in thirds]
    assert torch.equal(dense[1], -dense[0])
    assert torch.equal(weight.dequantize(torch.float32), torch.cat(dense, dim=1))
    rows = WIDE_MIN_ROWS + 3
    x_big = random_rows(rows, TILE_K, seed=15) * 2**20
    x_small = random_rows(rows, TILE_K, seed=16)
    x = torch.cat((x_big, x_big, x_small), dim=1)
    y = w4a16_matmul(x, weight, config=config, wide=wide)
    assert_close_to_fp32(y, x_small.float() @ dense[2].t())
    assert torch.equal(y, w4a16_matmul(x, weight, config=config, wide=None))


def test_stacked_weights_give_each_weight_its_columns():
    first, _, config = planar_case("awq", (48, 256, 32), seed=5)
    second, _, _ = planar_case("ct_asymmetric", (40, 256, 32), seed=6)
    stacked = concat_planar([first, second])
    x = random_rows(9, 256, seed=7)
    y = w4a16_matmul(x, stacked, config=dataclasses.replace(config, block_n=64))
    assert torch.equal(y[:, :48], w4a16_matmul(x, first, config=config))
    assert torch.equal(y[:, 48:], w4a16_matmul(x, second, config=config))
    with pytest.raises(ValueError, match="stacking needs"):
        concat_planar([first, planar_case("awq", (48, 256, 64))[0]])


def test_out_with_row_stride_and_no_rows():
    weight, _, config = planar_case("awq", SHAPES[0])
    x = random_rows(20, 256, seed=8)
    buffer = torch.zeros(20, 56, device=DEVICE, dtype=torch.bfloat16)
    out = buffer[:, :48]
    assert w4a16_matmul(x, weight, out=out, config=config) is out
    assert torch.equal(out, w4a16_matmul(x, weight, config=config))
    assert torch.equal(buffer[:, 48:], torch.zeros_like(buffer[:, 48:]))
    assert w4a16_matmul(x[:0], weight, config=config).shape == (0, 48)


def test_bad_inputs_raise():
    weight, packed, config = planar_case("awq", SHAPES[0])
    x = random_rows(4, 256, seed=9)
    with pytest.raises(ValueError, match="x must be"):
        w4a16_matmul(random_rows(4, 128, seed=9), weight)
    with pytest.raises(ValueError, match="x must be bf16"):
        w4a16_matmul(x.float(), weight)
    with pytest.raises(ValueError, match="unit last stride"):
        w4a16_matmul(random_rows(256, 4, seed=9).t(), weight)
    with pytest.raises(ValueError, match="out must be"):
        w4a16_matmul(x, weight, out=torch.empty(4, 47, device=DEVICE, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="give no out"):
        w4a16_matmul(x, weight, out=torch.empty(4, 48, device=DEVICE, dtype=torch.bfloat16),
                     keep_splits=True)  # fmt: skip
    with pytest.raises(ValueError, match="weight must be a PlanarInt4"):
        w4a16_matmul(x, packed)
    with pytest.raises(ValueError, match="block_m must be one of"):
        dataclasses.replace(config, block_m=48)


def test_repack_rejects_groups_that_split_a_plane_or_straddle_tiles():
    for group_size in (16, 96, 384):
        packed = packed_weight("ct_symmetric", 16, 768, group_size)
        with pytest.raises(ValueError, match="group_size must be a multiple of"):
            repack_planar(packed)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("key", list(tuned_launches()))
def test_each_tuned_shapes_row_buckets_give_the_same_bits(key):
    """A tuned shape's launches (one per row bucket) share its K split and differ in tile
    sizes, warps and stages only, which decide where a row is computed, not how: the same
    128 rows through each launch, bit for bit."""
    n, k = (int(size) for size in key.split(":")[0].split("x"))
    group_size = int(key.split(":g")[1])
    weight = repack_planar(packed_weight("awq", n, k, group_size, seed=3))
    x = random_rows(128, k, seed=11)
    launches = tuned_launches()[key]
    assert len({(c.tiles_per_split, c.split_k) for c in launches}) == 1
    first = w4a16_matmul(x, weight, config=launches[0])
    for config in launches[1:]:
        assert torch.equal(w4a16_matmul(x, weight, config=config), first), config


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(QWEN35_4B_SHAPES))
@pytest.mark.parametrize("kind", ["awq", "ct_asymmetric"])
def test_qwen35_4b_shapes(kind, name):
    """The shipped configs on Qwen3.5-4B's 4-bit shapes: the product, 8 verify blocks' rows
    against one block's and one row's (other row buckets' launches where the shape is tuned),
    and one-hot rows bit for bit (the asm unpacking)."""
    n, k = QWEN35_4B_SHAPES[name]
    packed = packed_weight(kind, n, k, QWEN35_GROUP)
    weight = repack_planar(packed)
    x = random_rows(128, k, seed=10)
    y128 = w4a16_matmul(x, weight)
    assert_close_to_reference(y128, x, weight)
    assert torch.equal(w4a16_matmul(x[:16], weight), y128[:16])
    for row in (0, 7, 77, 127):
        assert torch.equal(w4a16_matmul(x[row : row + 1], weight)[0], y128[row])
    eye = torch.eye(k, device=DEVICE, dtype=torch.bfloat16)[::37]
    expected = packed.dequantize(torch.bfloat16).t()[::37]
    assert torch.equal(w4a16_matmul(eye, weight), expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(QWEN35_4B_SHAPES))
def test_qwen35_4b_shapes_wide_launch(name):
    """The shipped wide tiles give the split launch's bits on the GPU, so a prompt's rows are
    the same whether it is prefilled alone or with others, at any row count."""
    n, k = QWEN35_4B_SHAPES[name]
    weight = repack_planar(packed_weight("awq", n, k, QWEN35_GROUP))
    x = random_rows(2 * WIDE_MIN_ROWS + 77, k, seed=17)
    y = w4a16_matmul(x, weight)
    assert torch.equal(y.view(torch.int16), w4a16_matmul(x, weight, wide=None).view(torch.int16))
    assert_close_to_reference(y, x, weight)
    assert torch.equal(w4a16_matmul(x[:16], weight), y[:16])
    assert torch.equal(w4a16_matmul(x[-WIDE_MIN_ROWS:], weight), y[-WIDE_MIN_ROWS:])
