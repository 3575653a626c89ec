"""Serving-path kernels compile one variant whatever the batch: their Triton specialization
keys do not change with row counts or with the offsets of index views.

A key that changes with the batch means a compile (0.1-0.4 s on the H200) in the middle of
someone's request, the first time that batch shape comes along. Keys are computed with
Triton's own specialization function (`tests/specialization_keys.py`), on the CPU.
"""

from __future__ import annotations

import torch

from dflash_serve.kernels.block_attention import (
    _combine_splits_kernel,
    _split_attention_kernel,
    block_attention,
)
from dflash_serve.kernels.rms_norm import (
    _gated_rms_norm_kernel,
    _rms_norm_kernel,
    gated_rms_norm,
    rms_norm,
)
from target_service.kernels.gated_delta_recurrence import (
    _recurrent_gated_delta_kernel,
    recurrent_gated_delta,
)
from tests.specialization_keys import launch_keys

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HIDDEN = 64
# Token counts a drafter's context or a verify block can have (1, odd, 16, 32), as [n, D]
# rows and as [B, n, D] batches.
ROW_SHAPES = [(1, HIDDEN), (5, HIDDEN), (16, HIDDEN), (32, HIDDEN), (3, 7, HIDDEN), (2, 16, HIDDEN)]


def distinct_keys(kernel, calls) -> set:
    return {key for call in calls for key in launch_keys(kernel, call)}


def test_rms_norm_compiles_one_variant_for_any_row_count():
    weight = torch.randn(HIDDEN, device=DEVICE)
    inputs = [torch.randn(shape, device=DEVICE) for shape in ROW_SHAPES]
    calls = [lambda x=x: rms_norm(x, weight, 1e-6, True) for x in inputs]
    assert len(distinct_keys(_rms_norm_kernel, calls)) == 1


def test_gated_rms_norm_compiles_one_variant_for_any_row_count():
    weight = torch.randn(HIDDEN, device=DEVICE)
    inputs = [
        (torch.randn(shape, device=DEVICE), torch.randn(shape, device=DEVICE))
        for shape in ROW_SHAPES
    ]
    calls = [lambda x=x, g=g: gated_rms_norm(x, g, weight, 1e-6) for x, g in inputs]
    assert len(distinct_keys(_gated_rms_norm_kernel, calls)) == 1


def test_recurrence_compiles_one_variant_for_any_batch_and_index_offset():
    """As the batch commit calls it: slots and per-row counts are views into one packed index
    tensor at offsets that depend on the batch's mix; token counts 1..16; 1..3 rows."""
    packed = torch.tensor([3, 0, 2, 1, 3, 0, 2], device=DEVICE)
    counts = torch.tensor([1, 16, 5, 2, 16, 3, 1], dtype=torch.int32, device=DEVICE)
    pool = torch.randn(4, 4, 16, 16, device=DEVICE)

    def replay(offset: int, rows: int, tokens: int):
        gen = torch.Generator().manual_seed(offset * 100 + rows * 10 + tokens)
        k = torch.randn(rows, tokens, 2, 16, generator=gen).to(DEVICE)
        v = torch.randn(rows, tokens, 4, 16, generator=gen).to(DEVICE)
        g = -torch.rand(rows, tokens, 4, generator=gen).to(DEVICE)
        beta = torch.rand(rows, tokens, 4, generator=gen).to(DEVICE)
        slots = packed[offset : offset + rows]
        num_tokens = counts[offset : offset + rows]
        return lambda: recurrent_gated_delta(
            k, k, v, g, beta, pool, pool.clone(), slots, num_tokens
        )

    calls = [
        replay(offset, rows, tokens)
        for offset in (0, 1, 2, 3)
        for rows in (1, 2, 3)
        for tokens in (1, 7, 16)
    ]
    assert len(distinct_keys(_recurrent_gated_delta_kernel, calls)) == 1


def test_block_attention_compiles_one_variant_for_any_batch_and_block_length():
    """Slots and starts as `ForwardBatch.on_device` and the drafter hold them: rows of one
    [2, B] tensor, so the starts are 8-byte aligned for odd B."""
    num_slots, cache_len, heads, kv_heads, head_dim = 4, 64, 4, 2, 16
    key_cache = torch.randn(num_slots, cache_len, kv_heads, head_dim, device=DEVICE)
    value_cache = torch.randn_like(key_cache)

    def attend(batch: int, tokens: int):
        q = torch.randn(batch, tokens, heads, head_dim, device=DEVICE)
        ids = torch.tensor([[3, 0, 2][:batch], [5, 17, 30][:batch]], device=DEVICE)
        return lambda: block_attention(q, key_cache, value_cache, ids[0], ids[1], 0.25)

    calls = [attend(batch, tokens) for batch in (1, 2, 3) for tokens in (1, 5, 16)]
    assert len(distinct_keys(_split_attention_kernel, calls)) == 1
    assert len(distinct_keys(_combine_splits_kernel, calls)) == 1


def test_row_wise_kernels_compile_one_variant_for_any_row_count():
    """The matmul (dense rows 1..128: a decode token up to 8 verify blocks), the SwiGLU and
    the per-head norm with rotary, as the verify and draft steps call them."""
    from dflash_serve.kernels.norm_rotary import _norm_rotary_kernel, norm_rotary
    from dflash_serve.kernels.row_matmul import _row_matmul_kernel, row_matmul
    from dflash_serve.kernels.silu_mul import _silu_mul_kernel, silu_mul

    weight = torch.randn(32, HIDDEN, device=DEVICE).to(torch.bfloat16)
    rows = (1, 5, 16, 17, 128)
    inputs = [torch.randn(m, HIDDEN, device=DEVICE).to(torch.bfloat16) for m in rows]
    matmuls = [lambda x=x: row_matmul(x, weight) for x in inputs]
    assert len(distinct_keys(_row_matmul_kernel, matmuls)) == 1
    swiglus = [lambda g=x: silu_mul(g, torch.randn_like(g)) for x in inputs]
    assert len(distinct_keys(_silu_mul_kernel, swiglus)) == 1
    norm_weight = torch.randn(16, device=DEVICE)

    def rotated(tokens: int):
        x = torch.randn(tokens, 4, 16, device=DEVICE)
        cos, sin = torch.randn(tokens, 8, device=DEVICE), torch.randn(tokens, 8, device=DEVICE)
        return lambda: norm_rotary(x, norm_weight, 1e-6, True, cos, sin)

    assert len(distinct_keys(_norm_rotary_kernel, [rotated(t) for t in rows])) == 1


def test_drafter_attention_inputs_compile_one_variant_for_any_batch_and_row_count():
    """Block rows (16 a sequence) and context rows (any count: an eager add, a fused step's
    16), slot ids a view into the caller's index tensor at any offset."""
    from dflash_serve.kernels.attention_inputs import (
        _attention_inputs_kernel,
        attention_inputs_into_cache,
    )

    cache = torch.zeros(4, 64, 2, 16, device=DEVICE)
    weight = torch.ones(16, device=DEVICE)

    def add(batch: int, tokens: int, q_heads: int):
        qkv = torch.randn(batch, tokens, (q_heads + 4) * 16, device=DEVICE)
        cos = torch.randn(batch, tokens, 16, device=DEVICE)
        ids = torch.tensor([[5, 17, 30][:batch], [3, 0, 2][:batch]], device=DEVICE)
        positions = ids[0].unsqueeze(1) + torch.arange(tokens, device=DEVICE)
        return lambda: attention_inputs_into_cache(
            qkv, q_heads, weight, weight, 1e-6, False, cos, cos, cache, cache, ids[1], positions
        )

    for q_heads in (0, 4):
        calls = [add(batch, tokens, q_heads) for batch in (1, 2, 3) for tokens in (1, 5, 16, 17)]
        assert len(distinct_keys(_attention_inputs_kernel, calls)) == 1
