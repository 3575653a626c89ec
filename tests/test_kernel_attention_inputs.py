"""The drafter's fused attention-input kernel against the steps it replaces.

Bit for bit: `norm_rotary` (the kernel) on the query and key heads, then indexed writes of
keys and values into the cache (the drafter's kernel path before this kernel). Against the
plain-torch reference within a few ulps (torch's own norm reduction). Cache entries at other
(slot, position) pairs stay as they were.
"""

from __future__ import annotations

import pytest
import torch

from dflash_serve.kernels.attention_inputs import (
    attention_inputs_into_cache,
    attention_inputs_into_cache_reference,
)
from dflash_serve.kernels.norm_rotary import norm_rotary
from dflash_serve.layers.rotary import RotaryEmbedding

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6
SLOTS, CACHE_LEN = 4, 40
# (query heads, kv heads, head_dim, rotary_dim): the 4B drafter's grouping, query heads
# absent (context rows), a partial rotation with a head dim that is not a power of two.
SHAPES = [(4, 2, 128, 128), (0, 2, 64, 64), (3, 1, 96, 32)]


def _problem(
    num_q_heads, num_kv_heads, dim, rotary_dim, dtype, seed, batch=3, tokens=5, zero_centred=False
):
    gen = torch.Generator().manual_seed(seed)
    width = (num_q_heads + 2 * num_kv_heads) * dim
    qkv = torch.randn((batch, tokens, width), generator=gen) * 3
    q_weight, k_weight = (torch.randn(dim, generator=gen) * 0.5 for _ in range(2))
    slot_ids = torch.tensor([2, 0, 3][:batch])
    starts = torch.randint(0, CACHE_LEN - tokens, (batch,), generator=gen)
    positions = starts.unsqueeze(1) + torch.arange(tokens)
    cos, sin = RotaryEmbedding(rotary_dim, 1e6).cos_sin(positions)
    cache = torch.randn((2, SLOTS, CACHE_LEN, num_kv_heads, dim), generator=gen)
    on_device = dict(device=DEVICE)
    return dict(
        qkv=qkv.to(DEVICE, dtype),
        num_q_heads=num_q_heads,
        q_weight=q_weight.to(DEVICE, dtype) if num_q_heads else None,
        k_weight=k_weight.to(DEVICE, dtype),
        eps=EPS,
        zero_centred=zero_centred,
        cos=cos.to(**on_device),
        sin=sin.to(**on_device),
        keys=cache[0].to(DEVICE, dtype).contiguous(),
        values=cache[1].to(DEVICE, dtype).contiguous(),
        slot_ids=slot_ids.to(**on_device),
        positions=positions.to(**on_device),
    )


def _copy(problem):
    return problem | {"keys": problem["keys"].clone(), "values": problem["values"].clone()}


def _two_steps(p):
    """The drafter's kernel path before the fused kernel: norm_rotary, then indexed writes."""
    num_kv_heads, dim = p["keys"].shape[-2:]
    heads = p["qkv"].reshape(*p["qkv"].shape[:-1], -1, dim)
    q, k, v = heads.split((p["num_q_heads"], num_kv_heads, num_kv_heads), dim=-2)
    args = (p["eps"], p["zero_centred"], p["cos"], p["sin"])
    rows = p["slot_ids"].unsqueeze(1)
    p["keys"][rows, p["positions"]] = norm_rotary(k, p["k_weight"], *args)
    p["values"][rows, p["positions"]] = v
    return norm_rotary(q, p["q_weight"], *args) if p["num_q_heads"] else None


@pytest.mark.parametrize("zero_centred", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_equals_norm_rotary_then_indexed_writes(shape, dtype, zero_centred):
    problem = _problem(*shape, dtype, seed=shape[2], zero_centred=zero_centred)
    before = problem["keys"].clone()
    fused, expected = _copy(problem), _copy(problem)
    queries = attention_inputs_into_cache(**fused)
    expected_queries = _two_steps(expected)
    if shape[0]:
        assert queries.shape == (3, 5, shape[0], shape[2]) and queries.dtype == dtype
        assert torch.equal(queries, expected_queries)
    else:
        assert queries is None
    assert torch.equal(fused["keys"], expected["keys"])
    assert torch.equal(fused["values"], expected["values"])
    assert not torch.equal(fused["keys"], before)  # (the test writes something)


# (query heads, kv heads, head_dim, rotary_dim): a small one, Qwen3.5-4B's attention layers.
GATED_SHAPES = [(4, 2, 64, 16), (16, 4, 256, 64)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", GATED_SHAPES)
def test_query_heads_interleaved_with_gates_are_read_with_their_stride(shape, dtype):
    """Qwen3.5: each query head is followed by its gate (query_stride 2·D); the gates are
    not read, and the queries equal norm_rotary of the strided view (zero-centred norms)."""
    num_q_heads, num_kv_heads, dim, rotary_dim = shape
    problem = _problem(
        2 * num_q_heads, num_kv_heads, dim, rotary_dim, dtype, seed=11, zero_centred=True
    )
    qkv = problem["qkv"]
    query_and_gate = qkv[..., : 2 * num_q_heads * dim].reshape(3, 5, num_q_heads, 2 * dim)
    q = query_and_gate[..., :dim]
    k_and_v = qkv[..., 2 * num_q_heads * dim :].reshape(3, 5, 2 * num_kv_heads, dim)
    unstrided = torch.cat((q.reshape(3, 5, -1), k_and_v.reshape(3, 5, -1)), dim=-1)
    strided, expected = _copy(problem), _copy(problem) | {"qkv": unstrided}
    expected["num_q_heads"] = strided["num_q_heads"] = num_q_heads
    queries = attention_inputs_into_cache(**strided, query_stride=2 * dim)
    expected_queries = _two_steps(expected)
    assert torch.equal(queries, expected_queries)
    assert torch.equal(strided["keys"], expected["keys"])
    assert torch.equal(strided["values"], expected["values"])
    args = (problem["eps"], True, problem["cos"], problem["sin"])
    assert torch.equal(queries, norm_rotary(q, problem["q_weight"], *args))
    plain = _copy(problem) | {"num_q_heads": num_q_heads}
    plain_queries = attention_inputs_into_cache_reference(**plain, query_stride=2 * dim)
    scale = plain_queries.abs().max().item()
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-20
    assert (queries.float() - plain_queries.float()).abs().max().item() <= 4 * ulp * scale


@pytest.mark.parametrize("shape", SHAPES)
def test_close_to_the_plain_torch_reference(shape):
    problem = _problem(*shape, torch.bfloat16, seed=7)
    fused, plain = _copy(problem), _copy(problem)
    queries = attention_inputs_into_cache(**fused)
    plain_queries = attention_inputs_into_cache_reference(**plain)
    pairs = [(fused["keys"], plain["keys"])]
    if shape[0]:
        pairs.append((queries, plain_queries))
    for got, want in pairs:
        scale = want.abs().max().item()
        assert (got.float() - want.float()).abs().max().item() <= 4 * 2.0**-7 * scale
    assert torch.equal(fused["values"], plain["values"])


def test_a_sequence_alone_gets_the_bits_it_gets_in_a_batch():
    problem = _problem(4, 2, 128, 128, torch.bfloat16, seed=9)
    together = _copy(problem)
    queries = attention_inputs_into_cache(**together)
    alone = _copy(problem)
    for b in range(3):
        one = alone | {
            key: problem[key][b : b + 1] for key in ("qkv", "cos", "sin", "slot_ids", "positions")
        }
        assert torch.equal(attention_inputs_into_cache(**one)[0], queries[b])
    assert torch.equal(alone["keys"], together["keys"])
    assert torch.equal(alone["values"], together["values"])


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"qkv": torch.zeros(3, 5, 10)}, "qkv must be"),
        ({"positions": torch.zeros(3, 4, dtype=torch.int64)}, "positions"),
        ({"slot_ids": torch.zeros(3, dtype=torch.int32)}, "int64"),
        ({"q_weight": None}, "q_weight"),
        ({"cos": torch.zeros(3, 5, 127)}, "cos and sin"),
        ({"query_stride": 64}, "query_stride"),
        ({"k_weight": torch.ones(64)}, "k_weight"),
    ],
)
def test_bad_inputs_are_refused(change, match):
    problem = _problem(4, 2, 128, 128, torch.bfloat16, seed=1)
    change = {
        key: value.to(DEVICE) if torch.is_tensor(value) else value for key, value in change.items()
    }
    with pytest.raises(ValueError, match=match):
        attention_inputs_into_cache(**(problem | change))


def test_a_cache_of_another_dtype_is_refused():
    problem = _problem(4, 2, 128, 128, torch.bfloat16, seed=1)
    with pytest.raises(ValueError, match="share a dtype"):
        attention_inputs_into_cache(**(problem | {"keys": problem["keys"].float()}))
