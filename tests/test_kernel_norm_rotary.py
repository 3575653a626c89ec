"""The fused q/k norm + rotary kernel against the two steps it replaces, and its row independence.

Bit for bit: the `rms_norm` kernel followed by torch's `apply_rotary` (the kernel path before
this kernel existed; the verify graphs' exactness rests on it). Against the plain-torch path
(torch's own reduction) the norm may differ by one ulp of x's dtype before the rotation, so
the gap is bounded by a few ulps of the output's scale.
"""

from __future__ import annotations

import pytest
import torch

from dflash_serve.kernels.norm_rotary import norm_rotary, norm_rotary_reference
from dflash_serve.kernels.rms_norm import rms_norm
from dflash_serve.layers.norms import RMSNorm
from dflash_serve.layers.rotary import RotaryEmbedding, apply_rotary

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6
# (leading dims, heads, head_dim, rotary_dim): the drafter (full rotation, 128-dim heads),
# Qwen3.5's attention (64 of 256 dims), a head dim that is not a power of two.
SHAPES = [
    ((2, 16), 4, 128, 128),
    ((1, 16), 2, 256, 64),
    ((5,), 3, 96, 32),
]


def _inputs(leading, heads, dim, rotary_dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((*leading, heads, dim), generator=gen)
    x = x * torch.rand((*leading, heads, 1), generator=gen) * 4
    weight = torch.randn(dim, generator=gen) * 0.5
    positions = torch.randint(0, 9000, leading, generator=gen)
    cos, sin = RotaryEmbedding(rotary_dim, 1e7).cos_sin(positions)
    return x.to(DEVICE, dtype), weight.to(DEVICE, dtype), cos.to(DEVICE), sin.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("zero_centred", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
def test_equals_norm_kernel_then_torch_rotary(shape, zero_centred, dtype):
    leading, heads, dim, rotary_dim = shape
    x, weight, cos, sin = _inputs(leading, heads, dim, rotary_dim, dtype, seed=dim)
    fused = norm_rotary(x, weight, EPS, zero_centred, cos, sin)
    two_steps = apply_rotary(rms_norm(x, weight, EPS, zero_centred), cos, sin)
    assert fused.shape == x.shape and fused.dtype == dtype and fused.is_contiguous()
    assert torch.equal(fused, two_steps)
    plain = norm_rotary_reference(x, weight, EPS, zero_centred, cos, sin)
    scale = plain.abs().max().item()
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-20
    assert (fused.float() - plain.float()).abs().max().item() <= 4 * ulp * scale


def test_reads_a_strided_query_view_in_place():
    """Qwen3.5's query is every other half-row of the query-and-gate projection."""
    x, weight, cos, sin = _inputs((2, 16), 4, 2 * 64, 32, torch.bfloat16, seed=3)
    query, _gate = x.reshape(2, 16, 4, 2, 64).unbind(-2)
    assert not query.is_contiguous()
    fused = norm_rotary(query, weight[:64], EPS, True, cos, sin)
    expected = norm_rotary(query.contiguous(), weight[:64], EPS, True, cos, sin)
    assert torch.equal(fused, expected)


def test_rows_do_not_depend_on_the_row_count():
    x, weight, cos, sin = _inputs((3, 16), 2, 256, 64, torch.bfloat16, seed=4)
    together = norm_rotary(x, weight, EPS, True, cos, sin)
    for b in range(3):
        for t in (0, 7, 15):
            alone = norm_rotary(
                x[b, t : t + 1], weight, EPS, True, cos[b, t : t + 1], sin[b, t : t + 1]
            )
            assert torch.equal(alone[0], together[b, t])


def test_cos_sin_broadcast_over_sequences():
    x, weight, cos, sin = _inputs((2, 5), 2, 64, 64, torch.float32, seed=5)
    shared_cos, shared_sin = cos[:1], sin[:1]
    fused = norm_rotary(x, weight, EPS, False, shared_cos, shared_sin)
    expected = apply_rotary(rms_norm(x, weight, EPS, False), shared_cos, shared_sin)
    assert torch.equal(fused, expected)


def test_module_uses_the_kernel_only_on_the_kernel_path():
    x, weight, cos, sin = _inputs((1, 16), 2, 256, 64, torch.bfloat16, seed=6)
    norm = RMSNorm(256, EPS, zero_centred=True).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(weight)
    plain = norm.norm_and_rotate(x, (cos, sin))
    assert torch.equal(plain, norm_rotary_reference(x, norm.weight, EPS, True, cos, sin))
    norm.use_row_kernel()
    assert torch.equal(
        norm.norm_and_rotate(x, (cos, sin)), norm_rotary(x, weight, EPS, True, cos, sin)
    )


@pytest.mark.parametrize(
    ("cos_shape", "rotary_dim", "match"),
    [((3, 16), 16, "broadcast"), ((2, 16), 15, "even"), ((2, 16), 130, "even")],
)
def test_bad_shapes_are_refused(cos_shape, rotary_dim, match):
    x = torch.zeros((2, 16, 2, 128), device=DEVICE)
    cos = torch.zeros((*cos_shape, rotary_dim), device=DEVICE)
    with pytest.raises(ValueError, match=match):
        norm_rotary(x, torch.ones(128, device=DEVICE), EPS, False, cos, cos)
