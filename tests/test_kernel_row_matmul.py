"""row_matmul against a plain fp32 product, and row independence bit for bit.

Tolerance: the kernel sums in fp32 and rounds once to bf16, a relative error of at most 2^-8;
its fp32 summation order differs from torch's, which costs far less than 2^-10 of the output
scale at these K. So |y - ref| <= 2^-8·|ref| + 2^-10·max|ref|, with ref the fp32 product of
the bf16 input and the bf16 weight. Where the product is exact (one-hot rows) and for row
independence the comparison is bit for bit. (4-bit weights read packed: test_kernel_w4a16_matmul.)
"""

import dataclasses

import pytest
import torch

from dflash_serve.kernels import row_matmul as row_matmul_module
from dflash_serve.kernels.row_matmul import (
    BLOCK_M,
    BY_ROWS,
    TMA_WIDE_LAUNCHES,
    WIDE_LAUNCH,
    WIDE_MIN_ROWS,
    WideLaunch,
    matmul_config,
    row_matmul,
    row_matmul_reference,
    sum_splits,
)
from dflash_serve.layers.split_sums import SplitSums
from tests.matmul_cases import (
    DEVICE,
    assert_close_to_fp32,
    assert_wide_launch_gives_split_bits,
    random_rows,
    random_weight,
)

# (N, K): N tiles masked or two with a ragged one; SPLIT_K 1 and > 1, a ragged last split (3
# splits over 5 blocks), a K tail; test_shapes_cover_both_split_paths checks the splits.
SHAPES = [(48, 64), (40, 320), (80, 96), (40, 1088)]
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


def make_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return random_weight(n, k, seed).bfloat16()


def assert_close_to_reference(y: torch.Tensor, x: torch.Tensor, oracle: torch.Tensor) -> None:
    assert_close_to_fp32(y, row_matmul_reference(x, oracle))


def test_shapes_cover_both_split_paths():
    splits = [matmul_config(n, k).split_k for n, k in SHAPES]
    assert 1 in splits and max(splits) > 1


@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference(shape):
    weight = make_weight(*shape)
    x = random_rows(37, shape[1], seed=1)
    assert_close_to_reference(row_matmul(x, weight), x, weight)


@pytest.mark.parametrize("shape", SHAPES[:2])
def test_one_hot_rows_pick_weight_columns(shape):
    """x = I gives y[k, n] = w[n, k] exactly: the weight tile is the oracle, bit for bit."""
    weight = make_weight(*shape)
    k = shape[1]
    step = max(1, k // 64)  # every split, in a few row tiles
    eye = torch.eye(k, device=DEVICE, dtype=torch.bfloat16)[::step]
    assert torch.equal(row_matmul(eye, weight), weight.t()[::step])


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


@pytest.mark.parametrize("shape", SHAPES[1:])
def test_rows_independent(shape):
    assert_rows_independent(random_rows(37, shape[1], seed=2), make_weight(*shape))


@pytest.mark.parametrize("row_tiles", [2, 4, 8])
def test_row_tiles_per_program_change_no_bit(row_tiles):
    """A program serving several row tiles with each weight tile gives every row the bits of
    one tile per program, for full, ragged and missing tiles (37 rows = 2 tiles + 5 rows)."""
    n, k = SHAPES[1]
    weight = make_weight(n, k)
    single = matmul_config(n, k)
    shared = dataclasses.replace(single, row_tiles=row_tiles)
    x = random_rows(37, k, seed=11)
    for rows in (1, 16, 37):
        expected = row_matmul(x[:rows], weight, config=single)
        assert torch.equal(row_matmul(x[:rows], weight, config=shared), expected), rows
    assert_close_to_reference(row_matmul(x, weight, config=shared), x, weight)


@pytest.mark.parametrize("row_tiles", [1, 2])
def test_64_row_tiles_keep_rows_independent(row_tiles, monkeypatch):
    """Tiles of 64 rows (Hopper's warpgroup MMA on the GPU): a row's bits do not depend on
    how many rows share the launch or where in a tile it sits, nor on row tiles per program;
    100 rows = a full tile and a ragged one."""
    n, k = SHAPES[1]
    weight = make_weight(n, k)
    config = dataclasses.replace(matmul_config(n, k), block_m=64, row_tiles=row_tiles)
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
    assert_close_to_reference(y100, x, weight)
    for rows in (slice(0, 1), slice(0, 16), slice(5, 37), slice(63, 65), slice(70, 100)):
        assert torch.equal(row_matmul(x[rows], weight, config=config), y100[rows]), rows


@pytest.mark.parametrize(("block_m", "row_tiles"), [(16, 1), (16, 2), (64, 1)])
def test_swapped_operands_keep_rows_independent(block_m, row_tiles):
    """swap_ab computes each tile transposed (weight tile on the MMA's tall side): the
    product stays within the reference's tolerance, and a row's bits do not depend on how
    many rows share the launch (37 rows: full, ragged and, with 64-row tiles, one tile)."""
    n, k = SHAPES[1]
    weight = make_weight(n, k)
    config = dataclasses.replace(matmul_config(n, k), block_m=block_m, row_tiles=row_tiles,
                                 swap_ab=True)  # fmt: skip
    x = random_rows(37, k, seed=13)
    y37 = row_matmul(x, weight, config=config)
    assert_close_to_reference(y37, x, weight)
    for rows in (slice(0, 1), slice(0, 16), slice(5, 37), slice(36, 37)):
        assert torch.equal(row_matmul(x[rows], weight, config=config), y37[rows]), rows


def wide_rows(k: int, seed: int) -> torch.Tensor:
    """More rows than WIDE_MIN_ROWS, with a ragged last row tile."""
    return random_rows(WIDE_MIN_ROWS + 45, k, seed=seed)


def with_interpreter_tiles(config):
    """(config, WideLaunch) whose dots are of one shape: under the interpreter a tile's dot is
    numpy's fp32 matmul, whose order may follow the tile's shape (on the GPU every tile shape
    runs the same MMA chain; the GPU test below checks the shipped tiles)."""
    config = dataclasses.replace(config, block_m=64)
    return config, WideLaunch(block_m=64, block_n=config.block_n, group_m=4)  # 9 row tiles


class RecordingLaunches:
    """A Triton kernel standing in for itself that records each launch's grid."""

    def __init__(self, kernel) -> None:
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


# Where TMA loads run: compiled on Hopper or newer, or the interpreter's emulation.
HAS_TMA = DEVICE == "cpu" or torch.cuda.get_device_capability()[0] >= 9
needs_tma = pytest.mark.skipif(not HAS_TMA, reason="needs TMA (Hopper or newer)")


@pytest.fixture(params=[pytest.param("tma", marks=needs_tma), "pointers"])
def wide_loads(request, monkeypatch):
    """Each wide-launch test through both kernels: operands loaded through TMA descriptors
    (what Hopper runs; the interpreter emulates them) and through pointers (other GPUs);
    after the test, each wide call went through that kernel and no other."""
    if request.param == "pointers":
        monkeypatch.setattr(row_matmul_module, "tma_loads_fit", lambda *operands: False)
    kernels = {"tma": "_wide_tma_matmul_kernel", "pointers": "_wide_matmul_kernel"}
    launches = {}
    for loads, name in kernels.items():
        launches[loads] = RecordingLaunches(getattr(row_matmul_module, name))
        monkeypatch.setattr(row_matmul_module, name, launches[loads])
    yield request.param
    other = "pointers" if request.param == "tma" else "tma"
    assert launches[request.param].grids and not launches[other].grids


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.usefixtures("wide_loads")
def test_wide_launch_gives_the_split_launch_bits(shape):
    """Many rows (prefill) take the wide launch: one program per output tile adding the K
    splits up as it goes, in groups of row tiles, with ragged row, column and K tiles."""
    n, k = shape
    weight = make_weight(n, k)
    config, wide = with_interpreter_tiles(matmul_config(n, k))
    x = wide_rows(k, seed=14)
    y = assert_wide_launch_gives_split_bits(row_matmul, x, weight, config, wide)
    assert_close_to_reference(y, x, weight)


@pytest.mark.usefixtures("wide_loads")
def test_wide_launch_adds_splits_in_order():
    """The cancelling splits of test_split_sum_order_is_fixed through the wide launch: each
    split's sum starts from zero and joins the total in order, so splits 0 and 1 still cancel
    exactly (one running sum over all of K would not)."""
    n, k = SHAPES[1]
    config, wide = with_interpreter_tiles(matmul_config(n, k))
    num_cancelling = config.k_per_split
    big = random_weight(n, num_cancelling, seed=7).bfloat16()
    small = random_weight(n, k - 2 * num_cancelling, seed=8).bfloat16()
    weight = torch.cat((big, -big, small), dim=1)
    rows = WIDE_MIN_ROWS + 3
    x_big = random_rows(rows, num_cancelling, seed=9) * 2**20
    x_small = random_rows(rows, k - 2 * num_cancelling, seed=10)
    x = torch.cat((x_big, x_big, x_small), dim=1)
    y = row_matmul(x, weight, config=config, wide=wide)
    assert_close_to_reference(y, x_small, small)
    assert torch.equal(y, row_matmul(x, weight, config=config, wide=None))


def test_fewer_rows_than_wide_min_take_the_split_launch(monkeypatch):
    n, k = SHAPES[1]
    launched = []
    monkeypatch.setattr(row_matmul_module, "_wide_matmul", lambda *args: launched.append(args))
    row_matmul(random_rows(WIDE_MIN_ROWS - 1, k, seed=1), make_weight(n, k))
    assert launched == []
    row_matmul(random_rows(WIDE_MIN_ROWS, k, seed=1), make_weight(n, k))
    assert len(launched) == 1


@pytest.mark.parametrize("fits", [pytest.param(True, marks=needs_tma), False])
def test_by_rows_the_wide_launch_takes_tma_tiles_for_its_rows_or_the_pointer_tiles(
    monkeypatch, fits
):
    """The default wide launch asks `tma_wide_launch` for the call's rows where TMA can load
    the operands and takes WIDE_LAUNCH where it cannot (here the tiles handed back are the
    interpreter's, so the bits can be checked too)."""
    n, k = SHAPES[1]
    weight = make_weight(n, k)
    config, interpreter_tiles = with_interpreter_tiles(matmul_config(n, k))
    asked = []

    def tma_wide_launch(rows):
        asked.append(rows)
        return interpreter_tiles

    monkeypatch.setattr(row_matmul_module, "tma_wide_launch", tma_wide_launch)
    monkeypatch.setattr(row_matmul_module, "tma_loads_fit", lambda *operands: fits)
    monkeypatch.setattr(row_matmul_module, "WIDE_LAUNCH", interpreter_tiles)
    x = wide_rows(k, seed=16)
    y = row_matmul(x, weight, config=config, wide=BY_ROWS)
    assert asked == ([x.shape[0]] if fits else [])
    assert torch.equal(y, row_matmul(x, weight, config=config, wide=None))


def test_tma_tiles_grow_with_the_rows_and_step_k_in_64s():
    launches = dict(TMA_WIDE_LAUNCHES)
    assert min(launches) == WIDE_MIN_ROWS
    for rows in (WIDE_MIN_ROWS, 1023, 1024, 4096):
        expected = max(r for r in launches if r <= rows)
        assert row_matmul_module.tma_wide_launch(rows) == launches[expected]
    assert row_matmul_module.tma_wide_launch(1024).block_n == 256
    config = matmul_config(12352, 2560)  # the GDN input projections: K steps of 128
    assert config.block_k == 128 and launches[1024].k_step(config) == 64
    odd = dataclasses.replace(config, block_k=32, k_per_split=96)
    assert launches[1024].k_step(odd) == 32  # 64 does not divide its splits
    assert WIDE_LAUNCH.k_step(config) == 128  # None: the config's


def test_the_wide_launch_is_asked_for_by_name():
    n, k = SHAPES[1]
    with pytest.raises(ValueError, match="wide must be"):
        row_matmul(wide_rows(k, seed=1), make_weight(n, k), wide="wide")
    with pytest.raises(ValueError, match="at least 512 rows"):
        row_matmul_module.tma_wide_launch(WIDE_MIN_ROWS - 1)


@needs_tma
def test_tma_loads_need_16_byte_aligned_operands():
    x = random_rows(9, 72, seed=17)
    assert row_matmul_module.tma_loads_fit(x, make_weight(16, 72))
    assert row_matmul_module.tma_loads_fit(x[1:])  # 144-byte rows: still aligned
    assert not row_matmul_module.tma_loads_fit(x.view(-1)[1:577].view(8, 72))  # base
    assert not row_matmul_module.tma_loads_fit(random_rows(8, 76, seed=18))  # 152-byte rows
    assert not row_matmul_module.tma_loads_fit(x[:1].expand(8, 72))  # rows that overlap


def test_row_tiles_must_be_a_power_of_two_up_to_8():
    with pytest.raises(ValueError, match="row_tiles must be"):
        dataclasses.replace(matmul_config(*SHAPES[1]), row_tiles=3)


def test_block_m_is_16_or_64():
    with pytest.raises(ValueError, match="block_m must be one of"):
        dataclasses.replace(matmul_config(*SHAPES[1]), block_m=32)


def test_split_sum_order_is_fixed():
    """Splits 0 and 1 cancel exactly (p + -p) and dwarf split 2, so in order 0, 1, 2 the sum
    is split 2's partial while any other order loses its low bits: a sum order that changed
    with M would show in the bf16 output, which random inputs mostly hide."""
    n, k = SHAPES[1]
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


@pytest.mark.parametrize("shape", SHAPES)
def test_kept_splits_sum_to_the_result(shape):
    """keep_splits hands on the partial sums where K is split: summed in split order in plain
    torch (fp32, one rounding to bf16) they are the result bit for bit; an unsplit shape's
    result comes back as it is."""
    n, k = shape
    weight = make_weight(n, k)
    x = random_rows(21, k, seed=11)
    expected = row_matmul(x, weight)
    kept = row_matmul(x, weight, keep_splits=True)
    splits = matmul_config(n, k).split_k
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
    n, k = SHAPES[1]
    weight = make_weight(n, k)
    x = random_rows(4, k, seed=12)
    with pytest.raises(ValueError, match="give no out"):
        row_matmul(x, weight, out=torch.empty(4, n, device=DEVICE, dtype=torch.bfloat16),
                   keep_splits=True)  # fmt: skip


def test_out_with_row_stride():
    n, k = SHAPES[2]
    weight = make_weight(n, k)
    x = random_rows(20, k, seed=3)
    buffer = torch.zeros(20, n + 8, device=DEVICE, dtype=torch.bfloat16)
    out = buffer[:, :n]
    assert row_matmul(x, weight, out=out) is out
    assert torch.equal(out, row_matmul(x, weight))
    assert torch.equal(buffer[:, n:], torch.zeros_like(buffer[:, n:]))


def test_bad_inputs_raise():
    weight = make_weight(48, 64)
    x = random_rows(4, 64, seed=4)
    with pytest.raises(ValueError, match="x must be"):
        row_matmul(random_rows(4, 32, seed=4), weight)
    with pytest.raises(ValueError, match="x must be bf16"):
        row_matmul(x.float(), weight)
    with pytest.raises(ValueError, match="out must be"):
        row_matmul(x, weight, out=torch.empty(4, 47, device=DEVICE, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="weight must be bf16"):
        row_matmul(x, weight.float())
    with pytest.raises(ValueError, match="weight must be a bf16 tensor"):
        row_matmul(x, [weight])
    with pytest.raises(ValueError, match="x must have a unit last stride"):
        row_matmul(random_rows(64, 4, seed=4).t(), weight)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(QWEN35_4B_SHAPES))
def test_qwen35_4b_shapes(name):
    n, k = QWEN35_4B_SHAPES[name]
    weight = make_weight(n, k)
    x = random_rows(128, k, seed=6)
    y128 = row_matmul(x, weight)
    assert_close_to_reference(y128, x, weight)
    assert torch.equal(row_matmul(x[:BLOCK_M], weight), y128[:BLOCK_M])
    for row in (0, 7, 77, 127):
        assert torch.equal(row_matmul(x[row : row + 1], weight)[0], y128[row])
    assert_rows_independent(x[:37], weight)


# Prefill's stacked matmuls too: gate+up, the GDN input projections (bf16: K steps of 128;
# with 4-bit qkv and z read from their copies, those two and b+a apart) and attention's q+k+v.
WIDE_SHAPES = QWEN35_4B_SHAPES | {
    "gate_up_stacked": (18432, 2560),
    "gdn_in_projs": (12352, 2560),
    "gdn_qkvz_copies": (12288, 2560),
    "gdn_ba": (64, 2560),
    "attention_qkv": (10240, 2560),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(WIDE_SHAPES))
def test_qwen35_4b_shapes_wide_launch(name):
    """The shipped WideLaunch tiles give the split launch's bits on the GPU (its MMA chain per
    output element does not depend on the tile's size), so a prompt's rows are the same
    whether it is prefilled alone or with others, at any row count: the TMA tiles of 1024+
    rows (1101 here) and of fewer (the last 512), in K steps of 64 whatever the config's."""
    n, k = WIDE_SHAPES[name]
    weight = make_weight(n, k)
    x = random_rows(2 * WIDE_MIN_ROWS + 77, k, seed=15)
    if torch.cuda.get_device_capability()[0] >= 9:  # Hopper: the TMA tiles for 1024+ rows
        assert row_matmul_module.tma_loads_fit(x, weight)
    y = row_matmul(x, weight)
    assert torch.equal(y.view(torch.int16), row_matmul(x, weight, wide=None).view(torch.int16))
    assert_close_to_reference(y, x, weight)
    assert torch.equal(row_matmul(x[:BLOCK_M], weight), y[:BLOCK_M])
    assert torch.equal(row_matmul(x[-WIDE_MIN_ROWS:], weight), y[-WIDE_MIN_ROWS:])
