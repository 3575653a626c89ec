"""The plain-torch attention paths against a naive softmax written here, query by query."""

from __future__ import annotations

import math

import pytest
import torch

from dflash_serve.layers.attention import (
    attend_all,
    attend_causal,
    attend_each_query,
    attend_masked,
)


def naive(q, keys, values, visible_counts, scale):
    """q [T, H, D]; keys/values [L, Hkv, D]; query t sees keys 0..visible_counts[t] − 1."""
    group = q.shape[1] // keys.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for t, count in enumerate(visible_counts):
        for h in range(q.shape[1]):
            k, v = keys[:count, h // group].double(), values[:count, h // group].double()
            weights = torch.softmax(k @ q[t, h].double() * scale, dim=0)
            out[t, h] = weights @ v
    return out


def random_qkv(num_seqs, num_new, num_keys, heads=8, kv_heads=2, dim=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(num_seqs, num_new, heads, dim, generator=generator)
    keys = torch.randn(num_seqs, num_keys, kv_heads, dim, generator=generator)
    values = torch.randn(num_seqs, num_keys, kv_heads, dim, generator=generator)
    return q, keys, values


@pytest.mark.parametrize(("num_new", "num_cached"), [(5, 0), (5, 9), (1, 12)])
def test_attend_causal_is_each_new_token_over_the_keys_up_to_its_own(num_new, num_cached):
    q, keys, values = random_qkv(2, num_new, num_cached + num_new)
    scale = 1 / math.sqrt(q.shape[-1])
    out = attend_causal(q, keys, values, scale)
    assert out.shape == q.shape
    counts = [num_cached + t + 1 for t in range(num_new)]
    for b in range(2):
        expected = naive(q[b], keys[b], values[b], counts, scale)
        torch.testing.assert_close(out[b].double(), expected, atol=1e-5, rtol=1e-5)


def test_attend_causal_gives_attend_masked_with_the_causal_mask():
    q, keys, values = random_qkv(1, 6, 10, seed=1)
    visible = torch.arange(10)[None, :] <= torch.arange(4, 10)[:, None]
    torch.testing.assert_close(
        attend_causal(q, keys, values, 0.3), attend_masked(q, keys, values, visible, 0.3)
    )


def test_attend_each_query_sees_exactly_its_range():
    q, keys, values = random_qkv(1, 3, 8, seed=2)
    out = attend_each_query(q[0], keys[0], values[0], [(0, 6), (0, 7), (0, 8)], 0.25)
    expected = naive(q[0], keys[0], values[0], [6, 7, 8], 0.25)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("num_new", "num_keys", "heads", "kv_heads"), [(16, 40, 8, 2), (3, 3, 4, 4)]
)
def test_attend_all_is_every_query_over_every_key(num_new, num_keys, heads, kv_heads):
    q, keys, values = random_qkv(1, num_new, num_keys, heads, kv_heads, seed=3)
    out = attend_all(q[0], keys[0], values[0], 0.3)
    assert out.shape == q[0].shape
    expected = naive(q[0], keys[0], values[0], [num_keys] * num_new, 0.3)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attend_causal_on_the_gpu_at_qwen35_4b_shapes(dtype):
    """On the GPU, 16 query heads over 4 key heads of 256 (bf16: SDPA's flash kernel; fp32:
    the masked path): the naive softmax's result to the dtype's rounding, for a chunk after
    cached tokens and a first one."""
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for num_new, num_cached in ((48, 80), (32, 0)):
        q, keys, values = random_qkv(2, num_new, num_cached + num_new, 16, 4, 256, seed=3)
        scale = 256**-0.5
        out = attend_causal(*(x.cuda().to(dtype) for x in (q, keys, values)), scale)
        counts = [num_cached + t + 1 for t in range(num_new)]
        for b in range(2):
            rounded = (x[b].to(dtype).double() for x in (q, keys, values))
            expected = naive(*rounded, counts, scale)
            torch.testing.assert_close(
                out[b].cpu().double(), expected, atol=tolerance, rtol=tolerance
            )
