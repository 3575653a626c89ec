"""Row-independent RMSNorm kernels against the torch modules, and their row independence.

Tolerances. The kernels repeat every step of `dflash_serve.layers.norms` except the order of
the Σx² reduction, which moves the fp32 inverse RMS by a few fp32 ulps:
- bf16 `rms_norm`: at most one bf16 ulp (the single final rounding may fall the other way);
- bf16 `gated_rms_norm`: `x̂` is rounded to bf16 (≤ 1 ulp apart, ≤ 2⁻⁷ relative), then the
  weight and gate products are rounded again (≤ 2⁻⁹ relative each), so ≤ 2⁻⁶ relative;
- fp32 outputs: at most 16 fp32 ulps (the reordered sum, rsqrt and up to three products; the
  CPU interpreter measures ≤ 7).
A few fp32 ulps rarely straddle a bf16 rounding boundary, so at most 1% of bf16 elements may
differ at all (the CPU interpreter measures 0); a skipped or misplaced rounding breaks that.
Row independence is bit-exact (`torch.equal`).
"""

from __future__ import annotations

import pytest
import torch

from dflash_serve.kernels.rms_norm import (
    add_rms_norm,
    add_rms_norm_reference,
    gated_rms_norm,
    gated_rms_norm_reference,
    rms_norm,
    rms_norm_reference,
)
from dflash_serve.layers.norms import GatedRMSNorm
from dflash_serve.layers.split_sums import SplitSums

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6
DIMS = (32, 128, 100, 2560)
MAX_BF16_ULPS = 1
MAX_GATED_BF16_RELATIVE = 2.0**-6
MAX_FP32_ULPS = 16
MAX_BF16_DIFFERING_FRACTION = 0.01


def _inputs(shape, dtype, seed):
    """Rows of varied scale, so the inverse RMS is not the same for every row."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.rand((*shape[:-1], 1), generator=gen) * 4
    gate = torch.randn(shape, generator=gen) * 3
    weight = torch.randn(shape[-1], generator=gen) * 0.5
    return x.to(DEVICE, dtype), gate.to(DEVICE, dtype), weight.to(DEVICE, dtype)


def _ulp_distance(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest number of representable values between matching elements (bf16 or fp32)."""
    assert a.dtype == b.dtype
    int_dtype = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[a.dtype]
    magnitude_mask = (1 << (8 * a.element_size() - 1)) - 1

    def ordered(t):
        bits = t.view(int_dtype).to(torch.int64)
        return torch.where(bits < 0, -(bits & magnitude_mask), bits)

    return int((ordered(a) - ordered(b)).abs().max())


def _assert_rms_close(actual, expected):
    if actual.dtype == torch.float32:
        assert _ulp_distance(actual, expected) <= MAX_FP32_ULPS
        return
    assert _ulp_distance(actual, expected) <= MAX_BF16_ULPS
    assert _differing_fraction(actual, expected) <= MAX_BF16_DIFFERING_FRACTION


def _assert_gated_close(actual, expected):
    if actual.dtype == torch.float32:
        assert _ulp_distance(actual, expected) <= MAX_FP32_ULPS
        return
    gap = (actual.float() - expected.float()).abs()
    assert bool((gap <= MAX_GATED_BF16_RELATIVE * expected.float().abs()).all())
    assert _differing_fraction(actual, expected) <= MAX_BF16_DIFFERING_FRACTION


def _differing_fraction(actual, expected) -> float:
    return float((actual != expected).float().mean())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dim", DIMS)
def test_rms_norm_matches_module(dim, dtype):
    x, _, weight = _inputs((3, 5, dim), dtype, seed=dim)
    for zero_centred in (True, False):
        actual = rms_norm(x, weight, EPS, zero_centred)
        assert actual.shape == x.shape and actual.dtype == dtype
        _assert_rms_close(actual, rms_norm_reference(x, weight, EPS, zero_centred))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dim", DIMS)
def test_gated_rms_norm_matches_module(dim, dtype):
    x, gate, weight = _inputs((3, 5, dim), dtype, seed=dim + 1)
    actual = gated_rms_norm(x, gate, weight, EPS)
    assert actual.shape == x.shape and actual.dtype == dtype
    _assert_gated_close(actual, gated_rms_norm_reference(x, gate, weight, EPS))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dim", (100, 2560))
def test_add_rms_norm_is_the_add_then_the_norm(dim, dtype):
    """The sum is torch's add bit for bit; the norm is the `rms_norm` kernel's of that sum bit
    for bit (same arithmetic), so fusing changes nothing; rows stay independent."""
    x, delta, weight = _inputs((3, 5, dim), dtype, seed=dim + 2)
    for zero_centred in (True, False):
        total, normed = add_rms_norm(x, delta, weight, EPS, zero_centred)
        expected_total, expected_norm = add_rms_norm_reference(x, delta, weight, EPS, zero_centred)
        assert torch.equal(total, expected_total)
        assert torch.equal(normed, rms_norm(expected_total, weight, EPS, zero_centred))
        _assert_rms_close(normed, expected_norm)
    alone_total, alone_normed = add_rms_norm(x[1:2, 3:4], delta[1:2, 3:4], weight, EPS, True)
    total, normed = add_rms_norm(x, delta, weight, EPS, True)
    assert torch.equal(alone_total[0, 0], total[1, 3])
    assert torch.equal(alone_normed[0, 0], normed[1, 3])


@pytest.mark.parametrize("dim", (100, 2560))
def test_add_rms_norm_sums_split_partials_as_the_matmul_would(dim):
    """A delta left as split-K partial sums gives, bit for bit, what the summed bf16 delta
    gives (summed in split order in plain torch, fp32, one rounding)."""
    x, _, weight = _inputs((3, 5, dim), torch.bfloat16, seed=dim + 5)
    generator = torch.Generator(device=DEVICE).manual_seed(dim)
    partials = torch.randn(4, 15, dim, generator=generator, device=DEVICE)
    partials[1] = -partials[0]  # an order other than 0, 1, 2, 3 would lose split 2's bits
    partials[0] *= 2**20
    partials[1] *= 2**20
    summed = ((partials[0] + partials[1]) + partials[2]) + partials[3]
    delta = summed.bfloat16().reshape(3, 5, dim)
    split = SplitSums(partials, (3, 5, dim))
    for zero_centred in (True, False):
        total, normed = add_rms_norm(x, split, weight, EPS, zero_centred)
        expected_total, expected_normed = add_rms_norm(x, delta, weight, EPS, zero_centred)
        assert torch.equal(total, expected_total) and torch.equal(normed, expected_normed)
        reference = add_rms_norm_reference(x, split, weight, EPS, zero_centred)
        assert torch.equal(reference[0], expected_total)


def test_add_rms_norm_rejects_bad_split_partials():
    x, _, weight = _inputs((2, 100), torch.bfloat16, seed=4)
    partials = torch.zeros(3, 2, 100, device=DEVICE)
    with pytest.raises(ValueError, match="contiguous fp32"):
        add_rms_norm(x, SplitSums(partials.double(), (2, 100)), weight, EPS, True)
    with pytest.raises(ValueError, match="partial sums"):
        add_rms_norm(x, SplitSums(partials[:, :1], (1, 100)), weight, EPS, True)
    with pytest.raises(ValueError, match="delta must be"):
        add_rms_norm(x.float(), SplitSums(partials, (2, 100)), weight.float(), EPS, True)


def test_add_rms_norm_rejects_a_mismatched_delta():
    x, delta, weight = _inputs((2, 100), torch.bfloat16, seed=3)
    with pytest.raises(ValueError, match="delta must be"):
        add_rms_norm(x, delta[:1], weight, EPS, True)
    with pytest.raises(ValueError, match="delta must be"):
        add_rms_norm(x, delta.float(), weight, EPS, True)


def test_mixed_dtypes_follow_torch_promotion():
    """fp32 weight on bf16 rows: `w · x̂` stays fp32 in the gated norm, as in torch."""
    x, gate, weight = _inputs((4, 2, 100), torch.bfloat16, seed=7)
    weight = weight.float() + 1e-3
    _assert_rms_close(rms_norm(x, weight, EPS, True), rms_norm_reference(x, weight, EPS, True))
    _assert_gated_close(
        gated_rms_norm(x, gate.float(), weight, EPS),
        gated_rms_norm_reference(x, gate.float(), weight, EPS),
    )


def test_strided_heads_and_out_argument():
    """Heads sliced from a wider projection are read in place; `out` may be the input."""
    slab = torch.randn(6, 2 * 4 * 32, device=DEVICE).to(torch.bfloat16)
    heads = slab[:, : 4 * 32].view(6, 4, 32)
    gate = slab[:, 4 * 32 :].view(6, 4, 32)
    weight = torch.randn(32, device=DEVICE).to(torch.bfloat16)
    expected = rms_norm_reference(heads, weight, EPS, True)
    out = torch.empty_like(expected)
    assert rms_norm(heads, weight, EPS, True, out=out) is out
    assert torch.equal(out, rms_norm(heads.contiguous(), weight, EPS, True))
    _assert_rms_close(out, expected)
    expected = gated_rms_norm_reference(heads, gate, weight, EPS)
    gated_rms_norm(heads, gate, weight, EPS, out=heads)
    _assert_gated_close(heads, expected)


def test_gated_norm_module_hands_a_sliced_gate_to_the_kernel_in_place():
    """The GDN layer's gate z is a column slice of its stacked input projection: the module
    passes the view itself (a copy was one launch per layer) and gets the copy's result."""
    slab = torch.randn(6, 3 * 4 * 32, device=DEVICE).to(torch.bfloat16)
    gate = slab[:, 4 * 32 : 2 * 4 * 32].view(6, 4, 32)
    x = torch.randn(6, 4, 32, device=DEVICE).to(torch.bfloat16)
    norm = GatedRMSNorm(32, EPS).to(DEVICE)
    norm.use_row_kernel()
    seen = []
    norm.kernel = lambda x, gate, *args: seen.append(gate) or gated_rms_norm(x, gate, *args)
    out = norm(x, gate)
    assert seen[0].data_ptr() == gate.data_ptr() and not seen[0].is_contiguous()
    assert torch.equal(out, gated_rms_norm(x, gate.contiguous(), norm.weight, EPS))


@pytest.mark.parametrize("dim", (100, 2560))
def test_rms_norm_rows_are_bit_identical_for_any_row_count(dim):
    x, _, weight = _inputs((128, dim), torch.bfloat16, seed=dim + 2)
    all_rows = rms_norm(x, weight, EPS, True)
    for rows in (slice(0, 1), slice(37, 38), slice(16, 32), slice(112, 128)):
        assert torch.equal(rms_norm(x[rows], weight, EPS, True), all_rows[rows])


@pytest.mark.parametrize("dim", (100, 128))
def test_gated_rms_norm_rows_are_bit_identical_for_any_row_count(dim):
    x, gate, weight = _inputs((128, dim), torch.bfloat16, seed=dim + 3)
    all_rows = gated_rms_norm(x, gate, weight, EPS)
    for rows in (slice(0, 1), slice(37, 38), slice(16, 32), slice(112, 128)):
        assert torch.equal(gated_rms_norm(x[rows], gate[rows], weight, EPS), all_rows[rows])


def test_bad_shapes_and_dtypes_raise():
    x, gate, weight = _inputs((4, 32), torch.bfloat16, seed=3)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, weight[:16], EPS, True)
    with pytest.raises(ValueError, match="weight"):
        gated_rms_norm(x, gate, weight[:16], EPS)
    with pytest.raises(ValueError, match="gate"):
        gated_rms_norm(x, gate[:2], weight, EPS)
    with pytest.raises(ValueError, match="out"):
        rms_norm(x, weight, EPS, True, out=torch.empty_like(x, dtype=torch.float32))
    with pytest.raises(ValueError, match="out"):
        rms_norm(x, weight, EPS, True, out=torch.empty(4, 64, device=DEVICE).bfloat16()[:, ::2])
    with pytest.raises(ValueError, match="x"):
        rms_norm(x.to(torch.int32), weight, EPS, True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_qwen35_4b_shapes_on_gpu():
    """8 sequences × 16 tokens: block norms (2560), q/k norms (16/4 heads × 256), GDN norm."""
    num_tokens = 8 * 16
    cases = [(num_tokens, 2560), (num_tokens, 16, 256), (num_tokens, 4, 256)]
    for index, shape in enumerate(cases):
        x, _, weight = _inputs(shape, torch.bfloat16, seed=10 + index)
        actual = rms_norm(x, weight, EPS, True)
        _assert_rms_close(actual, rms_norm_reference(x, weight, EPS, True))
        assert torch.equal(rms_norm(x[5:6], weight, EPS, True), actual[5:6])
        assert torch.equal(rms_norm(x[16:32], weight, EPS, True), actual[16:32])
    x, gate, weight = _inputs((num_tokens, 32, 128), torch.bfloat16, seed=20)
    actual = gated_rms_norm(x, gate, weight, EPS)
    _assert_gated_close(actual, gated_rms_norm_reference(x, gate, weight, EPS))
    assert torch.equal(gated_rms_norm(x[5:6], gate[5:6], weight, EPS), actual[5:6])
    assert torch.equal(gated_rms_norm(x[16:32], gate[16:32], weight, EPS), actual[16:32])
