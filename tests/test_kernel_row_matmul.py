"""row_matmul against a plain fp32 product, and row independence bit for bit.

Tolerance: the kernel sums in fp32 and rounds once to bf16, a relative error of at most 2^-8;
its fp32 summation order differs from torch's, which costs far less than 2^-10 of the output
scale at these K. So |y - ref| <= 2^-8·|ref| + 2^-10·max|ref|, with ref the fp32 product of
the bf16 input and the bf16 weight (4-bit: dequantized to bf16 by `PackedInt4Weight`, the
module's oracle). Where the product is exact (one-hot rows) and for row independence the
comparison is bit for bit.
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
from dflash_serve.kernels import row_matmul as row_matmul_module
from dflash_serve.kernels.row_matmul import (
    BLOCK_M,
    matmul_config,
    repack_int4,
    row_matmul,
    row_matmul_reference,
    sum_splits,
)
from dflash_serve.layers.split_sums import SplitSums

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KINDS = ["dense", "awq", "ct_symmetric", "ct_asymmetric"]
# (N, K, group): N tiles masked or two with a ragged one; SPLIT_K 1 and > 1 for both kinds,
# ragged last splits (dense: 3 splits over 5 blocks), several groups per 4-bit split, a dense
# K tail;
# test_shapes_cover_both_split_paths checks the splits.
SHAPES = [(48, 64, 32), (40, 320, 64), (80, 96, 32), (40, 1088, 32)]
QWEN35_4B_SHAPES = {
    "q_proj": (8192, 2560),
    "k_proj": (1024, 2560),
    "o_proj": (2560, 4096),
    "in_proj_z": (4096, 2560),
    "in_proj_a": (32, 2560),
    "gate_up": (9216, 2560),
    "down": (2560, 9216),
    "lm_head": (248320, 2560),
}
QWEN35_GROUP = 128


def random_weight(n: int, k: int, seed: int) -> torch.Tensor:
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(n, k, generator=generator, device=DEVICE) * 0.05


def random_rows(m: int, k: int, seed: int) -> torch.Tensor:
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(m, k, generator=generator, device=DEVICE).bfloat16()


def make_weight(kind: str, n: int, k: int, group_size: int, seed: int = 0):
    """(weight for row_matmul, its bf16 [N, K] oracle)."""
    weight = random_weight(n, k, seed)
    if kind == "dense":
        dense = weight.bfloat16()
        return dense, dense
    if kind == "awq":
        packed = PackedInt4Weight(AWQ_GEMM, n, k, group_size, pack_awq_gemm(weight, group_size))
    else:
        tensors = pack_compressed_tensors(weight, group_size, kind == "ct_symmetric")
        packed = PackedInt4Weight(COMPRESSED_TENSORS, n, k, group_size, tensors)
    return repack_int4(packed), packed.dequantize(torch.bfloat16)


def assert_close_to_reference(y: torch.Tensor, x: torch.Tensor, oracle: torch.Tensor) -> None:
    reference = row_matmul_reference(x, oracle)
    assert y.dtype == torch.bfloat16 and reference.dtype == torch.float32
    scale = reference.abs().max().item()
    torch.testing.assert_close(y.float(), reference, rtol=2**-8, atol=2**-10 * scale)


def test_shapes_cover_both_split_paths():
    dense_splits = [matmul_config(n, k).split_k for n, k, _ in SHAPES]
    int4_splits = [matmul_config(n, k, group_size).split_k for n, k, group_size in SHAPES]
    for splits in (dense_splits, int4_splits):
        assert 1 in splits and max(splits) > 1


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference(kind, shape):
    n, k, group_size = shape
    weight, oracle = make_weight(kind, n, k, group_size)
    x = random_rows(37, k, seed=1)
    assert_close_to_reference(row_matmul(x, weight), x, oracle)


@pytest.mark.parametrize("kind", KINDS[1:])
def test_repack_dequantizes_like_packed(kind):
    weight, oracle = make_weight(kind, *SHAPES[2])
    assert torch.equal(weight.dequantize(torch.bfloat16), oracle)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES[:2])
def test_one_hot_rows_pick_weight_columns(kind, shape):
    """x = I gives y[k, n] = w[n, k] exactly: the weight tile is the oracle, bit for bit."""
    n, k, group_size = shape
    weight, oracle = make_weight(kind, n, k, group_size)
    step = max(1, k // 64)  # every group and split, in a few row tiles
    eye = torch.eye(k, device=DEVICE, dtype=torch.bfloat16)[::step]
    assert torch.equal(row_matmul(eye, weight), oracle.t()[::step])


def assert_rows_independent(x: torch.Tensor, weight) -> None:
    """Rows of an M=16 call equal the same rows computed alone, with M=5 and with M=37."""
    assert x.shape[0] == 37
    y16 = row_matmul(x[:BLOCK_M], weight)
    assert torch.equal(row_matmul(x[:5], weight), y16[:5])
    y37 = row_matmul(x, weight)
    assert torch.equal(y37[:BLOCK_M], y16)
    for row in range(BLOCK_M):
        assert torch.equal(row_matmul(x[row : row + 1], weight)[0], y16[row])
    # The ragged last tile, and rows of another tile moved to the front of a launch.
    assert torch.equal(row_matmul(x[32:], weight), y37[32:])
    assert torch.equal(row_matmul(x[30:35], weight), y37[30:35])


@pytest.mark.parametrize("kind", ["dense", "awq", "ct_asymmetric"])
@pytest.mark.parametrize("shape", SHAPES[1:])
def test_rows_independent(kind, shape):
    n, k, group_size = shape
    weight, _ = make_weight(kind, n, k, group_size)
    assert_rows_independent(random_rows(37, k, seed=2), weight)


@pytest.mark.parametrize("kind", ["dense", "awq"])
@pytest.mark.parametrize("row_tiles", [2, 4, 8])
def test_row_tiles_per_program_change_no_bit(kind, row_tiles):
    """A program serving several row tiles with each weight tile gives every row the bits of
    one tile per program, for full, ragged and missing tiles (37 rows = 2 tiles + 5 rows)."""
    n, k, group_size = SHAPES[1]
    weight, oracle = make_weight(kind, n, k, group_size)
    single = matmul_config(n, k, None if kind == "dense" else group_size)
    shared = dataclasses.replace(single, row_tiles=row_tiles)
    x = random_rows(37, k, seed=11)
    for rows in (1, 16, 37):
        expected = row_matmul(x[:rows], weight, config=single)
        assert torch.equal(row_matmul(x[:rows], weight, config=shared), expected), rows
    assert_close_to_reference(row_matmul(x, weight, config=shared), x, oracle)


@pytest.mark.parametrize("kind", ["dense", "awq"])
@pytest.mark.parametrize("row_tiles", [1, 2])
def test_64_row_tiles_keep_rows_independent(kind, row_tiles, monkeypatch):
    """Tiles of 64 rows (Hopper's warpgroup MMA on the GPU): a row's bits do not depend on
    how many rows share the launch or where in a tile it sits, nor on row tiles per program;
    100 rows = a full tile and a ragged one."""
    n, k, group_size = SHAPES[1]
    weight, oracle = make_weight(kind, n, k, group_size)
    base = matmul_config(n, k, None if kind == "dense" else group_size)
    config = dataclasses.replace(base, block_m=64, row_tiles=row_tiles)
    x = random_rows(100, k, seed=12)
    launches = []
    kernel = row_matmul_module._row_matmul_kernel

    class RecordingKernel:  # the launch really uses 64-row tiles (the interpreter's dots
        def __getitem__(self, grid):  # are row-independent at any height)
            def launch(*args, **kwargs):
                launches.append((grid, kwargs["BLOCK_M"], kwargs["ROW_TILES"]))
                return kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(row_matmul_module, "_row_matmul_kernel", RecordingKernel())
    y100 = row_matmul(x, weight, config=config)
    assert launches == [((-(-100 // (64 * row_tiles)), launches[0][0][1], config.split_k), 64,
                         row_tiles)]  # fmt: skip
    assert_close_to_reference(y100, x, oracle)
    for rows in (slice(0, 1), slice(0, 16), slice(5, 37), slice(63, 65), slice(70, 100)):
        assert torch.equal(row_matmul(x[rows], weight, config=config), y100[rows]), rows


@pytest.mark.parametrize("kind", ["dense", "awq", "ct_asymmetric"])
@pytest.mark.parametrize(("block_m", "row_tiles"), [(16, 1), (16, 2), (64, 1)])
def test_swapped_operands_keep_rows_independent(kind, block_m, row_tiles):
    """swap_ab computes each tile transposed (weight tile on the MMA's tall side): the
    product stays within the reference's tolerance, and a row's bits do not depend on how
    many rows share the launch (37 rows: full, ragged and, with 64-row tiles, one tile)."""
    n, k, group_size = SHAPES[1]
    weight, oracle = make_weight(kind, n, k, group_size)
    base = matmul_config(n, k, None if kind == "dense" else group_size)
    config = dataclasses.replace(base, block_m=block_m, row_tiles=row_tiles, swap_ab=True)
    x = random_rows(37, k, seed=13)
    y37 = row_matmul(x, weight, config=config)
    assert_close_to_reference(y37, x, oracle)
    for rows in (slice(0, 1), slice(0, 16), slice(5, 37), slice(36, 37)):
        assert torch.equal(row_matmul(x[rows], weight, config=config), y37[rows]), rows


NIBBLE_TILINGS = [(16, 1, False), (64, 2, False), (16, 2, True), (64, 1, True)]


@pytest.mark.parametrize("kind", ["awq", "ct_symmetric", "ct_asymmetric"])
@pytest.mark.parametrize(("block_m", "row_tiles", "swap_ab"), NIBBLE_TILINGS)
@pytest.mark.parametrize("split_k", [1, 3])
def test_nibble_planes_keep_rows_independent(kind, block_m, row_tiles, swap_ab, split_k):
    """k_by_nibble sums each 128-input tile as 8 nibble planes (another K order, so other
    bits than the plain tile): within the reference's tolerance, and a row's bits do not
    depend on how many rows share the launch; 5 K tiles over 3 splits leave a short one."""
    n, k, group_size = 40, 640, 128
    weight, oracle = make_weight(kind, n, k, group_size)
    config = dataclasses.replace(
        matmul_config(n, k, group_size), block_k=128, k_per_split=256 if split_k > 1 else k,
        split_k=split_k, block_m=block_m, row_tiles=row_tiles, swap_ab=swap_ab,
        k_by_nibble=True,
    )  # fmt: skip
    x = random_rows(37, k, seed=14)
    y37 = row_matmul(x, weight, config=config)
    assert_close_to_reference(y37, x, oracle)
    for rows in (slice(0, 1), slice(0, 16), slice(5, 37), slice(36, 37)):
        assert torch.equal(row_matmul(x[rows], weight, config=config), y37[rows]), rows


def test_nibble_planes_need_4_bit_weights_and_128_input_tiles():
    n, k, group_size = 40, 640, 128
    base = dataclasses.replace(matmul_config(n, k, group_size), block_k=128, k_per_split=k,
                               split_k=1)  # fmt: skip
    for block_k in (64, 384):
        with pytest.raises(ValueError, match="block_k a power of two >= 128"):
            dataclasses.replace(base, block_k=block_k, k_by_nibble=True)
    dense, _ = make_weight("dense", n, k, group_size)
    with pytest.raises(ValueError, match="4-bit weight"):
        row_matmul(
            random_rows(2, k, seed=1), dense, config=dataclasses.replace(base, k_by_nibble=True)
        )


def test_row_tiles_must_be_a_power_of_two_up_to_8():
    with pytest.raises(ValueError, match="row_tiles must be"):
        dataclasses.replace(matmul_config(*SHAPES[1][:2]), row_tiles=3)


def test_block_m_is_16_or_64():
    with pytest.raises(ValueError, match="block_m must be one of"):
        dataclasses.replace(matmul_config(*SHAPES[1][:2]), block_m=32)


def test_split_sum_order_is_fixed():
    """Splits 0 and 1 cancel exactly (p + -p) and dwarf split 2, so in order 0, 1, 2 the sum
    is split 2's partial while any other order loses its low bits: a sum order that changed
    with M would show in the bf16 output, which random inputs mostly hide."""
    n, k, _ = SHAPES[1]
    config = matmul_config(n, k)
    num_cancelling = config.k_per_split
    assert config.split_k == 3 and k > 2 * num_cancelling
    big = random_weight(n, num_cancelling, seed=7).bfloat16()
    small = random_weight(n, k - 2 * num_cancelling, seed=8).bfloat16()
    weight = torch.cat((big, -big, small), dim=1)
    x_big = random_rows(37, num_cancelling, seed=9) * 2**20
    x_small = random_rows(37, k - 2 * num_cancelling, seed=10)
    x = torch.cat((x_big, x_big, x_small), dim=1)
    assert_close_to_reference(row_matmul(x, weight), x_small, small)
    assert_rows_independent(x, weight)


@pytest.mark.parametrize("kind", ["dense", "awq"])
@pytest.mark.parametrize("shape", SHAPES)
def test_kept_splits_sum_to_the_result(kind, shape):
    """keep_splits hands on the partial sums where K is split: summed in split order in plain
    torch (fp32, one rounding to bf16) they are the result bit for bit; an unsplit shape's
    result comes back as it is."""
    n, k, group_size = shape
    weight, _ = make_weight(kind, n, k, group_size)
    x = random_rows(21, k, seed=11)
    expected = row_matmul(x, weight)
    kept = row_matmul(x, weight, keep_splits=True)
    splits = matmul_config(n, k, None if kind == "dense" else group_size).split_k
    if splits == 1:
        assert isinstance(kept, torch.Tensor) and torch.equal(kept, expected)
        return
    assert isinstance(kept, SplitSums) and kept.partials.shape == (splits, 21, n)
    summed = kept.partials[0].clone()
    for partial in kept.partials[1:]:
        summed += partial
    assert torch.equal(summed.bfloat16(), expected)
    assert torch.equal(kept.total(), expected)
    assert torch.equal(sum_splits(kept.partials), expected)


def test_kept_splits_take_no_out():
    n, k, group_size = SHAPES[1]
    weight, _ = make_weight("dense", n, k, group_size)
    x = random_rows(4, k, seed=12)
    with pytest.raises(ValueError, match="give no out"):
        row_matmul(x, weight, out=torch.empty(4, n, device=DEVICE, dtype=torch.bfloat16),
                   keep_splits=True)  # fmt: skip


def test_out_with_row_stride():
    n, k, group_size = SHAPES[2]
    weight, _ = make_weight("awq", n, k, group_size)
    x = random_rows(20, k, seed=3)
    buffer = torch.zeros(20, n + 8, device=DEVICE, dtype=torch.bfloat16)
    out = buffer[:, :n]
    assert row_matmul(x, weight, out=out) is out
    assert torch.equal(out, row_matmul(x, weight))
    assert torch.equal(buffer[:, n:], torch.zeros_like(buffer[:, n:]))


def test_bad_inputs_raise():
    dense, _ = make_weight("dense", 48, 64, 32)
    int4, _ = make_weight("awq", 48, 64, 32)
    x = random_rows(4, 64, seed=4)
    for weight in (dense, int4):
        with pytest.raises(ValueError, match="x must be"):
            row_matmul(random_rows(4, 32, seed=4), weight)
        with pytest.raises(ValueError, match="x must be bf16"):
            row_matmul(x.float(), weight)
        with pytest.raises(ValueError, match="out must be"):
            row_matmul(x, weight, out=torch.empty(4, 47, device=DEVICE, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="weight must be bf16"):
        row_matmul(x, dense.float())
    with pytest.raises(ValueError, match="x must have a unit last stride"):
        row_matmul(random_rows(64, 4, seed=4).t(), dense)


def test_repack_rejects_unsupported_groups():
    weight = random_weight(16, 64, seed=5)
    bad_k = pack_compressed_tensors(weight[:, :36], 36, symmetric=True)
    with pytest.raises(ValueError, match="in_features must be a multiple of 8"):
        repack_int4(PackedInt4Weight(COMPRESSED_TENSORS, 16, 36, 36, bad_k))
    small_group = pack_compressed_tensors(weight, 8, symmetric=True)
    with pytest.raises(ValueError, match="group_size must be a multiple of 16"):
        repack_int4(PackedInt4Weight(COMPRESSED_TENSORS, 16, 64, 8, small_group))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(QWEN35_4B_SHAPES))
@pytest.mark.parametrize("kind", ["dense", "awq", "ct_asymmetric"])
def test_qwen35_4b_shapes(kind, name):
    n, k = QWEN35_4B_SHAPES[name]
    if kind != "dense" and name == "lm_head":
        pytest.skip("the lm_head is never quantized")
    weight, oracle = make_weight(kind, n, k, QWEN35_GROUP)
    x = random_rows(128, k, seed=6)
    y128 = row_matmul(x, weight)
    assert_close_to_reference(y128, x, oracle)
    assert torch.equal(row_matmul(x[:BLOCK_M], weight), y128[:BLOCK_M])
    for row in (0, 7, 77, 127):
        assert torch.equal(row_matmul(x[row : row + 1], weight)[0], y128[row])
    assert_rows_independent(x[:37], weight)
