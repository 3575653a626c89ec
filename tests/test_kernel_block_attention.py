"""The block-attention Triton kernel against a naive masked softmax, and its row independence.

On CPU the kernel runs in Triton's interpreter (tests/conftest.py), so shapes stay small.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from dflash_serve.kernels.block_attention import (
    LaunchConfig,
    block_attention,
    block_attention_reference,
    launch_config,
)
from dflash_serve.layers.activations import sigmoid

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_problem(
    num_heads, num_kv_heads, head_dim, num_tokens, starts, *, num_slots=4, cache_len=160, seed=0
):
    """Random q and a random (everywhere, stale positions included) cache; slots non-contiguous."""
    gen = torch.Generator().manual_seed(seed)
    num_seqs = len(starts)
    q = torch.randn(num_seqs, num_tokens, num_heads, head_dim, generator=gen)
    cache_shape = (num_slots, cache_len, num_kv_heads, head_dim)
    key_cache = torch.randn(cache_shape, generator=gen)
    value_cache = torch.randn(cache_shape, generator=gen)
    slots = torch.randperm(num_slots, generator=gen)[:num_seqs]
    to = dict(device=DEVICE, dtype=torch.bfloat16)
    return (
        q.to(**to),
        key_cache.to(**to),
        value_cache.to(**to),
        slots.to(DEVICE),
        torch.tensor(starts, dtype=torch.int32, device=DEVICE),
    )


def naive_attention(q, key_cache, value_cache, slots, starts, scale, causal=True, window=None):
    """fp32 softmax over all L positions with the keys a query may not see set to −inf."""
    num_seqs, num_tokens, num_heads, _ = q.shape
    cache_len, num_kv_heads = key_cache.shape[1:3]
    group = num_heads // num_kv_heads
    outputs = []
    for b in range(num_seqs):
        keys = key_cache[slots[b]].float().repeat_interleave(group, dim=1)  # [L, H, D]
        values = value_cache[slots[b]].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,lhd->thl", q[b].float(), keys) * scale
        query_pos = (starts[b] + torch.arange(num_tokens, device=q.device))[:, None]
        key_pos = torch.arange(cache_len, device=q.device)[None, :]
        if causal:
            hidden = key_pos > query_pos  # [T, L]
        else:
            hidden = (key_pos >= starts[b] + num_tokens).expand(num_tokens, -1)
        if window is not None:
            hidden = hidden | (query_pos - key_pos >= window)
            if not causal:
                hidden = hidden | (key_pos - query_pos >= window)
        scores = scores.masked_fill(hidden[:, None, :], float("-inf"))
        outputs.append(torch.einsum("thl,lhd->thd", torch.softmax(scores, dim=-1), values))
    return torch.stack(outputs)


def assert_close_to_naive(out, expected):
    # Not bit-equal: the kernel rounds its output to bf16 (half an ulp, 2^-9 relative) and P to
    # bf16 before P·V (2^-9 relative per weight). Measured: at most 1.9e-2 where |out| ≈ 3, about
    # one bf16 ulp there; the fp32 test below bounds everything else at 1e-5.
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.parametrize("num_tokens", [1, 5, 16])
@pytest.mark.parametrize("starts", [[0, 7, 70], [57, 130, 3]])
def test_matches_naive_attention(head_dim, num_tokens, starts):
    problem = random_problem(4, 2, head_dim, num_tokens, starts, seed=num_tokens + head_dim)
    scale = head_dim**-0.5
    expected = naive_attention(*problem, scale)
    assert_close_to_naive(block_attention(*problem, scale), expected)
    reference = block_attention_reference(*problem, scale)
    assert_close_to_naive(reference, expected)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(6, 2), (8, 1), (2, 2)])
def test_awkward_groups_match_naive_attention(num_heads, num_kv_heads):
    """A group of 3 (padded rows), of 8 (16 tokens need two tiles) and of 1."""
    problem = random_problem(num_heads, num_kv_heads, 32, 16, [66, 9], seed=num_heads)
    expected = naive_attention(*problem, 0.2)
    assert_close_to_naive(block_attention(*problem, 0.2), expected)


def test_fp32_matches_naive_attention_tightly():
    q, key_cache, value_cache, slots, starts = random_problem(4, 2, 32, 5, [0, 70, 31])
    problem = (q.float(), key_cache.float(), value_cache.float(), slots, starts.long())
    out = block_attention(*problem, 0.3)
    assert out.dtype == torch.float32
    # fp32 throughout (IEEE dot, no P rounding): only the summation order differs.
    torch.testing.assert_close(out, naive_attention(*problem, 0.3), atol=1e-5, rtol=1e-5)


# (causal, window): the drafter's rules. Windows of 1 (a query sees itself only), 5 (inside the
# block: the non-causal hi is p + window), 20 (starts and ends inside a 64-key tile) and 70 (the
# window reaches over a key tile boundary, so the first tiles are skipped).
RULES = [(False, None), (True, 1), (True, 5), (False, 5), (True, 70), (False, 20)]


@pytest.mark.parametrize(("causal", "window"), RULES)
@pytest.mark.parametrize("num_tokens", [5, 16])
def test_rules_match_naive_attention(causal, window, num_tokens):
    problem = random_problem(4, 2, 32, num_tokens, [0, 3, 130], seed=num_tokens + (window or 0))
    rule = dict(causal=causal, window=window)
    expected = naive_attention(*problem, 0.2, **rule)
    assert_close_to_naive(block_attention(*problem, 0.2, **rule), expected)
    assert_close_to_naive(block_attention_reference(*problem, 0.2, **rule), expected)


@pytest.mark.parametrize(("causal", "window"), [(False, None), (True, 5), (False, 20)])
def test_rules_in_fp32_match_naive_attention_tightly(causal, window):
    q, key_cache, value_cache, slots, starts = random_problem(8, 1, 16, 16, [2, 77], seed=3)
    problem = (q.float(), key_cache.float(), value_cache.float(), slots, starts)
    rule = dict(causal=causal, window=window)
    out = block_attention(*problem, 0.3, **rule)
    torch.testing.assert_close(out, naive_attention(*problem, 0.3, **rule), atol=1e-5, rtol=1e-5)


def assert_rows_independent(problem, scale, window=None, config=None):
    """Bit-equality of each query alone, each prefix of the block and each sequence alone
    (causal rules: a query's keys do not depend on the block's length)."""
    q, key_cache, value_cache, slots, starts = problem
    rule = dict(window=window, config=config)
    full = block_attention(*problem, scale, **rule)
    for t in range(q.shape[1]):
        alone = block_attention(
            q[:, t : t + 1], key_cache, value_cache, slots, starts + t, scale, **rule
        )
        assert torch.equal(alone[:, 0], full[:, t]), f"token {t}"
    prefix = block_attention(q[:, :5], key_cache, value_cache, slots, starts, scale, **rule)
    assert torch.equal(prefix, full[:, :5])
    assert_sequences_independent(problem, scale, full, **rule)
    return full


def assert_sequences_independent(problem, scale, full, **rule):
    q, key_cache, value_cache, slots, starts = problem
    for b in range(q.shape[0]):
        one = block_attention(
            q[b : b + 1], key_cache, value_cache, slots[b : b + 1], starts[b : b + 1], scale, **rule
        )
        assert torch.equal(one[0], full[b]), f"sequence {b}"


def test_rows_are_bit_independent_of_block_and_batch():
    assert_rows_independent(random_problem(4, 2, 64, 16, [0, 57, 130]), 0.125)


def test_windowed_rows_are_bit_independent_of_block_and_batch():
    """A window of 70 skips the first key tile for some queries but not for others."""
    assert_rows_independent(random_problem(4, 2, 32, 16, [0, 57, 130]), 0.125, window=70)


@pytest.mark.parametrize(("causal", "window"), [(False, None), (False, 20)])
def test_non_causal_sequences_are_bit_independent_of_batch(causal, window):
    problem = random_problem(8, 2, 32, 16, [0, 57, 130], seed=5)
    full = block_attention(*problem, 0.125, causal=causal, window=window)
    assert_sequences_independent(problem, 0.125, full, causal=causal, window=window)


def small_splits(num_heads, num_kv_heads, head_dim):
    """Chunks of 32 keys made of two 16-key blocks: a query at position 130 merges 5 chunks."""
    default = launch_config(num_heads, num_kv_heads, head_dim)
    return dataclasses.replace(default, block_n=16, split_keys=32)


@pytest.mark.parametrize(("causal", "window"), [(True, None), *RULES])
def test_many_splits_match_naive_attention(causal, window):
    starts = [0, 40, 130]
    config = small_splits(4, 2, 32)
    # The last sequence's queries see up to 146 keys: 5 chunks of 32 to merge without a window,
    # 3 or 4 with the window of 70.
    assert starts[-1] // config.split_keys >= 4
    problem = random_problem(4, 2, 32, 16, starts, seed=11)
    rule = dict(causal=causal, window=window)
    expected = naive_attention(*problem, 0.2, **rule)
    assert_close_to_naive(block_attention(*problem, 0.2, **rule, config=config), expected)


@pytest.mark.parametrize(("causal", "window"), [(True, None), (False, None), (True, 70)])
def test_many_splits_in_fp32_match_naive_attention_tightly(causal, window):
    q, key_cache, value_cache, slots, starts = random_problem(8, 2, 16, 7, [3, 150], seed=12)
    problem = (q.float(), key_cache.float(), value_cache.float(), slots, starts)
    rule = dict(causal=causal, window=window)
    out = block_attention(*problem, 0.3, **rule, config=small_splits(8, 2, 16))
    torch.testing.assert_close(out, naive_attention(*problem, 0.3, **rule), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 40])
def test_rows_over_many_splits_are_bit_independent_of_block_and_batch(window):
    problem = random_problem(4, 2, 32, 16, [0, 57, 130], seed=13)
    assert_rows_independent(problem, 0.125, window=window, config=small_splits(4, 2, 32))


@pytest.mark.parametrize(("causal", "window"), [(True, None), (False, 20)])
def test_rows_are_bit_independent_of_how_many_programs_share_the_chunks(causal, window):
    """One program per tile looping over every chunk, two, or one per chunk (the default)."""
    problem = random_problem(4, 2, 32, 16, [0, 57, 130], seed=15)
    config = small_splits(4, 2, 32)
    rule = dict(causal=causal, window=window)
    expected = block_attention(*problem, 0.125, **rule, config=config)
    for min_programs in (1, 7):
        fewer = dataclasses.replace(config, min_programs=min_programs)
        assert torch.equal(block_attention(*problem, 0.125, **rule, config=fewer), expected)


@pytest.mark.parametrize("config", [None, small_splits(4, 2, 32)], ids=["default", "small"])
@pytest.mark.parametrize(("causal", "window"), [(True, None), (False, None), (False, 20)])
def test_rows_are_bit_independent_of_cache_length(config, causal, window):
    """More cache positions (so more, empty, chunks) past every visible key change no bit."""
    q, key_cache, value_cache, slots, starts = random_problem(
        4, 2, 32, 16, [0, 57, 130], cache_len=400, seed=14
    )
    rule = dict(causal=causal, window=window, config=config)
    outputs = [
        block_attention(
            q,
            key_cache[:, :cache_len].contiguous(),
            value_cache[:, :cache_len].contiguous(),
            slots,
            starts,
            0.125,
            **rule,
        )
        for cache_len in (146, 160, 257, 400)
    ]
    for cache_len, out in zip((160, 257, 400), outputs[1:], strict=True):
        assert torch.equal(out, outputs[0]), f"L={cache_len}"


@pytest.mark.parametrize(("causal", "window"), [(True, None), *RULES])
def test_cache_outside_the_visible_keys_is_never_read(causal, window):
    """Other slots and positions no query of a block sees are NaN: the output is bit-identical."""
    q, key_cache, value_cache, slots, starts = random_problem(4, 2, 32, 16, [0, 57, 130])
    rule = dict(causal=causal, window=window)
    expected = block_attention(q, key_cache, value_cache, slots, starts, 0.2, **rule)
    is_read = torch.zeros(key_cache.shape[:2], dtype=torch.bool, device=DEVICE)
    num_tokens = q.shape[1]
    for slot, start in zip(slots.tolist(), starts.tolist(), strict=True):
        lo = 0 if window is None else max(0, start - window + 1)
        hi = start + num_tokens
        is_read[slot, lo:hi] = True
    poisoned = [
        c.masked_fill(~is_read[:, :, None, None], float("nan")) for c in (key_cache, value_cache)
    ]
    out = torch.empty_like(q)
    returned = block_attention(q, *poisoned, slots, starts, 0.2, **rule, out=out)
    assert returned is out
    assert torch.equal(out, expected)


def test_qwen35_4b_tile_is_16_tokens_by_4_heads():
    qwen35_4b = launch_config(16, 4, 256)
    assert (qwen35_4b.tile_tokens, qwen35_4b.block_m) == (16, 64)


@pytest.mark.parametrize("head_dim", [16, 64, 128, 256])
def test_chunks_end_on_key_block_boundaries(head_dim):
    config = launch_config(16, 4, head_dim)
    assert config.split_keys % config.block_n == 0


def replace_config(**changes) -> LaunchConfig:
    """The config of the (4, 2, 32) heads below with some fields changed."""
    return dataclasses.replace(launch_config(4, 2, 32), **changes)


@pytest.mark.parametrize(
    ("argument", "change"),
    [
        ("q", lambda a: {**a, "q": a["q"][0]}),
        ("q", lambda a: {**a, "q": a["q"].half()}),
        ("key_cache", lambda a: {**a, "key_cache": a["key_cache"][..., :16]}),
        ("key_cache", lambda a: {**a, "key_cache": a["key_cache"].float()}),
        ("value_cache", lambda a: {**a, "value_cache": a["value_cache"][:, :8]}),
        ("key_cache", lambda a: {**a, "q": a["q"][:, :, :3]}),
        ("slots", lambda a: {**a, "slots": a["slots"][:1]}),
        ("slots", lambda a: {**a, "slots": a["slots"].int()}),
        ("start_positions", lambda a: {**a, "start_positions": a["start_positions"].float()}),
        ("out", lambda a: {**a, "out": torch.empty_like(a["q"][:, :1])}),
        ("gate", lambda a: {**a, "gate": torch.empty_like(a["q"][..., :16])}),
        ("gate", lambda a: {**a, "gate": torch.empty_like(a["q"]).float()}),
        ("gate", lambda a: {**a, "gate": torch.empty_like(a["q"]).transpose(2, 3)}),
        ("window", lambda a: {**a, "window": 0}),
        ("window", lambda a: {**a, "window": 2.5}),
        ("config", lambda a: {**a, "config": replace_config(split_keys=96)}),
        ("config", lambda a: {**a, "config": replace_config(tile_tokens=16, block_m=16)}),
        ("config", lambda a: {**a, "config": replace_config(min_programs=0)}),
    ],
)
def test_bad_inputs_raise_value_error_naming_the_argument(argument, change):
    q, key_cache, value_cache, slots, starts = random_problem(4, 2, 32, 4, [3, 9])
    args = dict(
        q=q, key_cache=key_cache, value_cache=value_cache, slots=slots, start_positions=starts
    )
    with pytest.raises(ValueError, match=argument):
        block_attention(**change(args), scale=0.1)


def strided_gates(q: torch.Tensor, seed: int) -> torch.Tensor:
    """Gates as Qwen3.5's verify reads them: each head's half of a [.., heads, 2·D] projection."""
    gen = torch.Generator().manual_seed(seed)
    projection = 3 * torch.randn(*q.shape[:3], 2 * q.shape[3], generator=gen)
    return projection.to(q.device, q.dtype)[..., q.shape[3] :]


def assert_gate_applied_as_torch_applies_it(problem, scale, seed):
    """The gated launch against the ungated one times `activations.sigmoid` in torch (five
    launches of bf16 ops), bit for bit."""
    gates = strided_gates(problem[0], seed)
    gated = block_attention(*problem, scale, gate=gates)
    expected = block_attention(*problem, scale) * sigmoid(gates)
    assert torch.equal(gated, expected)
    assert not torch.equal(gated, block_attention(*problem, scale))


@pytest.mark.parametrize(("num_tokens", "starts"), [(1, [0, 9]), (5, [40, 3])])
def test_gate_is_applied_as_torch_applies_it(num_tokens, starts):
    problem = random_problem(4, 2, 32, num_tokens, starts, seed=3)
    assert_gate_applied_as_torch_applies_it(problem, 0.2, seed=4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gate_is_applied_as_torch_applies_it_at_qwen35_4b_shapes_on_gpu():
    starts = [0, 15, 1000, 4000]
    problem = random_problem(16, 4, 256, 16, starts, num_slots=10, cache_len=4096, seed=11)
    assert_gate_applied_as_torch_applies_it(problem, 256**-0.5, seed=12)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_qwen35_4b_shapes_on_gpu():
    starts = [0, 15, 63, 64, 1000, 2047, 3500, 4000]
    problem = random_problem(16, 4, 256, 16, starts, num_slots=10, cache_len=4096, seed=7)
    scale = 256**-0.5
    full = assert_rows_independent(problem, scale)
    assert_close_to_naive(full, naive_attention(*problem, scale))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("causal", "window"), [(True, 1000), (False, None), (False, 1000)])
def test_dflash_4b_drafter_shapes_on_gpu(causal, window):
    """The 4B drafter's heads (32 query, 8 kv, dim 128); a window shorter than the context."""
    starts = [0, 15, 63, 64, 1000, 2047, 3500, 4000]
    problem = random_problem(32, 8, 128, 16, starts, num_slots=10, cache_len=4096, seed=9)
    scale = 128**-0.5
    rule = dict(causal=causal, window=window)
    if causal:
        full = assert_rows_independent(problem, scale, window=window)
    else:
        full = block_attention(*problem, scale, **rule)
        assert_sequences_independent(problem, scale, full, **rule)
    assert_close_to_naive(full, naive_attention(*problem, scale, **rule))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_replay_follows_new_start_positions():
    q, key_cache, value_cache, slots, starts = random_problem(
        16, 4, 256, 16, [5, 300], num_slots=3, cache_len=1024, seed=8
    )
    out = torch.empty_like(q)
    block_attention(q, key_cache, value_cache, slots, starts, 0.0625, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        block_attention(q, key_cache, value_cache, slots, starts, 0.0625, out=out)
    starts.copy_(torch.tensor([700, 17], dtype=torch.int32))
    slots.copy_(slots.flip(0))
    graph.replay()
    expected = block_attention(q, key_cache, value_cache, slots, starts, 0.0625)
    assert torch.equal(out, expected)
