"""The Triton gated delta recurrence against a naive fp32 oracle, and its bit-exact properties.

Closeness to the oracle is fp32 rounding only (different summation order, approximate exp and
rsqrt on the GPU). The properties speculative decoding relies on are bit-exact, so they are
checked with torch.equal: one call of T tokens equals T chained one-token calls, a row is the
same alone or in a batch, and a replay of n tokens lands on the state of an n-token call.
"""

from __future__ import annotations

import pytest
import torch

from target_service.kernels.gated_delta_recurrence import (
    recurrent_gated_delta,
    recurrent_gated_delta_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUM_SLOTS = 4


def make_inputs(batch, tokens, key_heads, value_heads, dk, dv, dtype, seed, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, tokens, key_heads, dk, generator=gen).to(dtype)
    k = torch.randn(batch, tokens, key_heads, dk, generator=gen).to(dtype)
    v = torch.randn(batch, tokens, value_heads, dv, generator=gen).to(dtype)
    g = -torch.rand(batch, tokens, value_heads, generator=gen) * 2
    beta = torch.rand(batch, tokens, value_heads, generator=gen)
    pool = torch.randn(NUM_SLOTS, value_heads, dk, dv, generator=gen)
    return [x.to(device) for x in (q, k, v, g, beta, pool)]


def naive_recurrence(q, k, v, g, beta, pool, slots):
    """Token loop with einsum, all fp32: (outputs [B, T, Hv, Dv], states [B, Hv, Dk, Dv])."""
    q, k, v = q.float(), k.float(), v.float()
    group = v.shape[2] // q.shape[2]
    q = (q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)).repeat_interleave(group, dim=2)
    k = (k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)).repeat_interleave(group, dim=2)
    q = q * q.shape[-1] ** -0.5
    state = pool[slots].clone()
    outputs = []
    for t in range(q.shape[1]):
        state = state * torch.exp(g[:, t])[..., None, None]
        remembered = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        update = beta[:, t, :, None] * (v[:, t] - remembered)
        state = state + torch.einsum("bhk,bhv->bhkv", k[:, t], update)
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(outputs, dim=1), state


def run(fn, q, k, v, g, beta, pool, slots, num_tokens=None, with_out=True):
    """Call fn out of place on a copy of the pool; returns (out or None, new pool)."""
    final = pool.clone()
    out = torch.full(v.shape, float("nan"), device=v.device) if with_out else None
    fn(q, k, v, g, beta, pool, final, slots, num_tokens=num_tokens, out=out)
    return out, final


SHAPES = [
    # (batch, tokens, dk, dv, slots)
    (2, 3, 32, 32, [2, 0]),
    (1, 16, 32, 32, [1]),
    (3, 1, 64, 64, [3, 0, 1]),
    (1, 3, 64, 32, [2]),
    (2, 2, 24, 20, [0, 3]),  # not powers of two: masked tiles
]


@pytest.mark.parametrize("fn", [recurrent_gated_delta, recurrent_gated_delta_reference])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("batch", "tokens", "dk", "dv", "slot_list"), SHAPES)
def test_matches_naive_outputs_and_states(fn, dtype, batch, tokens, dk, dv, slot_list):
    q, k, v, g, beta, pool = make_inputs(batch, tokens, 2, 4, dk, dv, dtype, seed=tokens + dk)
    slots = torch.tensor(slot_list, device=DEVICE)
    expected_out, expected_states = naive_recurrence(q, k, v, g, beta, pool, slots)
    out, final = run(fn, q, k, v, g, beta, pool, slots)
    # fp32 rounding only (measured ≤ 5e-7 on CPU).
    torch.testing.assert_close(out, expected_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final[slots], expected_states, atol=1e-5, rtol=1e-5)
    untouched = [s for s in range(NUM_SLOTS) if s not in slot_list]
    assert torch.equal(final[untouched], pool[untouched])


def check_chained_equals_block(inputs, slots):
    """(a) One call over T tokens == T one-token calls chained through the state pool."""
    q, k, v, g, beta, pool = inputs
    block_out, block_final = run(recurrent_gated_delta, *inputs, slots)
    chained = pool.clone()
    for t in range(q.shape[1]):
        step = [x[:, t : t + 1] for x in (q, k, v, g, beta)]
        step_out = torch.empty_like(block_out[:, :1])
        recurrent_gated_delta(*step, chained, chained, slots, out=step_out)
        assert torch.equal(step_out, block_out[:, t : t + 1]), t
    assert torch.equal(chained, block_final)


def check_row_alone_equals_batched(inputs, slots):
    """(b) A row's outputs and state do not depend on the other rows of the launch."""
    batch_out, batch_final = run(recurrent_gated_delta, *inputs, slots)
    pool = inputs[-1]
    for row in range(len(slots)):
        alone = [x[row : row + 1] for x in inputs[:-1]]
        row_out, row_final = run(recurrent_gated_delta, *alone, pool, slots[row : row + 1])
        assert torch.equal(row_out[0], batch_out[row]), row
        assert torch.equal(row_final[slots[row]], batch_final[slots[row]]), row


def check_replay_equals_prefix(inputs, slots, kept):
    """(c) Replaying the first n tokens (fp32 copies, no outputs) == an n-token call."""
    q, k, v, g, beta, pool = inputs
    num_tokens = torch.tensor(kept, dtype=torch.int32, device=pool.device)
    replay_inputs = (k.float(), k.float(), v.float(), g, beta, pool, slots)
    _, replayed = run(recurrent_gated_delta, *replay_inputs, num_tokens, with_out=False)
    block_out, _ = run(recurrent_gated_delta, *inputs, slots)
    for row, n in enumerate(kept):
        if n == 0:
            assert torch.equal(replayed[slots[row]], pool[slots[row]]), row
            continue
        prefix = [x[row : row + 1, :n] for x in (q, k, v, g, beta)]
        prefix_out, prefix_final = run(recurrent_gated_delta, *prefix, pool, slots[row : row + 1])
        assert torch.equal(replayed[slots[row]], prefix_final[slots[row]]), row
        assert torch.equal(prefix_out[0], block_out[row, :n]), row


def test_block_equals_chained_single_tokens():
    inputs = make_inputs(2, 4, 2, 4, 16, 16, torch.bfloat16, seed=5)
    check_chained_equals_block(inputs, torch.tensor([2, 0], device=DEVICE))


def test_row_alone_equals_row_in_batch():
    inputs = make_inputs(3, 4, 2, 4, 16, 16, torch.bfloat16, seed=6)
    check_row_alone_equals_batched(inputs, torch.tensor([3, 0, 1], device=DEVICE))


def test_replay_equals_state_after_prefix():
    inputs = make_inputs(3, 4, 2, 4, 16, 16, torch.bfloat16, seed=7)
    check_replay_equals_prefix(inputs, torch.tensor([1, 3, 0], device=DEVICE), kept=[2, 4, 1])


def test_replay_of_zero_tokens_copies_state_and_leaves_outputs():
    q, k, v, g, beta, pool = make_inputs(2, 3, 2, 4, 16, 16, torch.float32, seed=8)
    slots = torch.tensor([2, 0], device=DEVICE)
    num_tokens = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    out, final = run(recurrent_gated_delta, q, k, v, g, beta, pool, slots, num_tokens=num_tokens)
    assert torch.equal(final[2], pool[2])
    assert out[0].isnan().all() and out[1, 1:].isnan().all() and not out[1, 0].isnan().any()


def test_in_place_equals_out_of_place():
    q, k, v, g, beta, pool = make_inputs(2, 3, 2, 4, 16, 16, torch.bfloat16, seed=9)
    slots = torch.tensor([2, 0], device=DEVICE)
    expected_out, expected_final = run(recurrent_gated_delta, q, k, v, g, beta, pool, slots)
    in_place = pool.clone()
    out = torch.empty_like(expected_out)
    recurrent_gated_delta(q, k, v, g, beta, in_place, in_place, slots, out=out)
    assert torch.equal(out, expected_out)
    assert torch.equal(in_place, expected_final)


def test_bf16_outputs_are_the_fp32_outputs_rounded():
    """Outputs written in bf16 are the fp32 outputs each rounded once (as `.to` rounds), and
    the states do not change."""
    q, k, v, g, beta, pool = make_inputs(2, 5, 2, 4, 16, 16, torch.bfloat16, seed=10)
    slots = torch.tensor([2, 0], device=DEVICE)
    expected_out, expected_final = run(recurrent_gated_delta, q, k, v, g, beta, pool, slots)
    final = pool.clone()
    out = torch.empty(v.shape, dtype=torch.bfloat16, device=DEVICE)
    recurrent_gated_delta(q, k, v, g, beta, pool, final, slots, out=out)
    assert torch.equal(out, expected_out.to(torch.bfloat16))
    assert torch.equal(final, expected_final)


def _bad(name):
    q, k, v, g, beta, pool = make_inputs(2, 3, 2, 4, 8, 8, torch.float32, seed=0)
    args = dict(q=q, k=k, v=v, g=g, beta=beta, initial_states=pool, final_states=pool.clone())
    args |= dict(slots=torch.tensor([2, 0], device=DEVICE), num_tokens=None, out=None)
    bad = {
        "q": q[0],
        "k": k[:, :2],
        "v": v[:, :, :3],
        "g": g.to(torch.bfloat16),
        "beta": beta[:, :, :2],
        "initial_states": pool[:, :, :4],
        "final_states": pool[:3].clone(),
        "slots": args["slots"].to(torch.int32),
        "num_tokens": torch.tensor([1, 2], device=DEVICE),
        "out": torch.zeros(v.shape, dtype=torch.float16, device=DEVICE),
    }
    args[name] = bad[name]
    return args


@pytest.mark.parametrize(
    "name",
    ["q", "k", "v", "g", "beta", "initial_states", "final_states", "slots", "num_tokens", "out"],
)
@pytest.mark.parametrize("fn", [recurrent_gated_delta, recurrent_gated_delta_reference])
def test_bad_arguments_raise_value_error_naming_them(fn, name):
    with pytest.raises(ValueError, match=rf"^{name} "):
        fn(**_bad(name))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_qwen35_4b_shapes_on_gpu():
    inputs = make_inputs(8, 16, 16, 32, 128, 128, torch.bfloat16, seed=10, device="cuda")
    slots = torch.tensor([5, 0, 7, 2, 9, 11, 3, 14], device="cuda")
    inputs[-1] = torch.randn(16, 32, 128, 128, device="cuda")
    out, final = run(recurrent_gated_delta, *inputs, slots)
    # The oracle on CPU so that no TF32 or GPU reduction order enters it.
    cpu = [x.cpu() for x in inputs]
    expected_out, expected_states = naive_recurrence(*cpu, slots.cpu())
    torch.testing.assert_close(out.cpu(), expected_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final[slots].cpu(), expected_states, atol=1e-5, rtol=1e-5)
    check_chained_equals_block(inputs, slots)
    check_row_alone_equals_batched(inputs, slots)
    check_replay_equals_prefix(inputs, slots, kept=[1, 16, 5, 0, 8, 15, 2, 12])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_index_views_at_any_offset_reuse_one_compiled_kernel():
    """The batch commit passes slots and counts as views into one packed index tensor, 8-byte
    aligned or 16 depending on the batch's mix; each new alignment used to compile another
    variant mid-request (0.1-0.4 s). Both offsets must run the kernel compiled first."""
    from target_service.kernels.gated_delta_recurrence import _recurrent_gated_delta_kernel

    q, k, v, g, beta, pool = make_inputs(2, 3, 2, 4, 16, 16, torch.float32, seed=11, device="cuda")
    packed = torch.tensor([2, 0, 1, 3, 0, 2], device="cuda")  # slots at offset 0 and at 1
    counts = torch.tensor([3, 1, 2, 2], dtype=torch.int32, device="cuda")
    results = []
    for offset in (0, 1):
        slots, num_tokens = packed[offset : offset + 2], counts[offset : offset + 2]
        if offset == 0:
            run(recurrent_gated_delta, q, k, v, g, beta, pool, slots, num_tokens)
            cache = _recurrent_gated_delta_kernel.device_caches[torch.cuda.current_device()][0]
            compiled = len(cache)
        results.append(run(recurrent_gated_delta, q, k, v, g, beta, pool, slots, num_tokens))
    assert packed[1:].data_ptr() % 16 == 8  # the second call really is 8-byte aligned
    assert len(cache) == compiled
    # And the unaligned views computed what fresh (aligned) copies compute.
    expected = run(recurrent_gated_delta, q, k, v, g, beta, pool, packed[1:3].clone(),
                   counts[1:3].clone())  # fmt: skip
    # (Output rows past a row's count stay NaN, as `run` fills them: compared as equal.)
    for got, want in zip(results[1], expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
