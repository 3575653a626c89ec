"""Prompts of sessions starting together prefilled in one padded forward, one row each.

The oracle is each prompt prefilled alone on a fresh engine (the same padded run length):
a row's logits, taps and the states its later tokens read must be the same bits, since the
engine only groups prompts where every kernel is row-independent. The prompts of a group
have different lengths and slots, so a row reading another row's length or slot fails.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from dflash_serve.errors import InvalidRequestError
from dflash_serve.layers.linear import fits_row_kernel, row_kernels_up_to
from dflash_serve.speculative.types import SamplingParams
from target_service import prefill_graphs, speculative_step
from target_service import session as session_module
from target_service.engine import TargetEngine
from target_service.model.state import StateShape
from target_service.session import InProcessTarget
from target_service.speculative_step import (
    PrefillRequest,
    VerifyRequest,
    prefill_and_choose,
    run_target_batch,
)
from tests import prefill_checks
from tests.prefill_checks import greedy_tokens, record_padded_forwards

TAP = 1
RUN_TOKENS = (16, 32, 64)
PROMPTS = (
    [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 1, 2, 3, 4, 5, 6, 7],
    [7 * i % 97 + 1 for i in range(32)],
    [5] * 20,
)  # 18, 32 and 20 tokens: one run length, 32
LONG_WAIT_US = 500_000  # sessions starting together must meet in one batch


def new_engine(model, prefill_batch_rows=128, run_tokens=RUN_TOKENS, max_slots=4):
    shape = StateShape(max_slots=max_slots, max_len=96)
    return TargetEngine(
        model,
        shape,
        (TAP,),
        prefill_run_tokens=run_tokens,
        prefill_batch_rows=prefill_batch_rows,
    )


def assert_each_as_alone(model, engine, slots, prompts, results):
    def new_alone_engine():
        return new_engine(model, prefill_batch_rows=0)

    prefill_checks.assert_each_as_alone(engine, slots, prompts, results, new_alone_engine, 4)


def test_prompts_prefilled_together_equal_each_alone_on_the_reference_path(
    reference_model, monkeypatch
):
    engine = new_engine(reference_model)
    slots = [engine.open_sequence() for _ in PROMPTS]
    forwards = record_padded_forwards(monkeypatch)
    results = engine.prefill_together(slots, list(PROMPTS))
    assert forwards == [(3, 32)]
    monkeypatch.undo()
    assert_each_as_alone(reference_model, engine, slots, PROMPTS, results)


def test_prompts_prefilled_together_equal_each_alone_on_the_kernel_path(cpu_kernel_model):
    """The Triton kernels (interpreted here) at 2 × 16 rows, within the 64 they take."""
    prompts = [PROMPTS[0][:13], PROMPTS[1][:9]]
    engine = new_engine(cpu_kernel_model, prefill_batch_rows=None, run_tokens=(16,))
    assert engine.prefill_batch_rows == 64 and engine.prefill_group_size(16) == 4
    slots = [engine.open_sequence() for _ in prompts]
    results = engine.prefill_together(slots, prompts)
    assert_each_as_alone(cpu_kernel_model, engine, slots, prompts, results)


def test_short_prompts_share_a_forward_beyond_the_kernel_rows_on_the_kernels(
    cpu_kernel_model, monkeypatch
):
    """A budget above the 64 rows the kernels take: four prompts of run length 32 share one
    forward of 128 rows, which still runs on the row kernels (alone each takes them: 32
    rows), so each keeps its bits; on cuBLAS's stand-in (the CPU matmul) they would differ.
    Run lengths above 64 rows never share."""
    engine = new_engine(cpu_kernel_model, prefill_batch_rows=128, run_tokens=(32, 96))
    assert engine.prefill_group_size(32) == 4 and engine.prefill_group_size(96) == 1
    prompts = [PROMPTS[0][:17], PROMPTS[1][:32], PROMPTS[2][:20], PROMPTS[1][:25]]
    slots = [engine.open_sequence() for _ in prompts]
    forwards = record_padded_forwards(monkeypatch)
    results = engine.prefill_together(slots, prompts)
    assert forwards == [(4, 32)]
    monkeypatch.undo()
    assert_each_as_alone(cpu_kernel_model, engine, slots, prompts, results)


def test_asking_for_more_rows_never_turns_the_kernel_path_on():
    """`row_kernels_up_to` widens the kernel path where a layer has one, never where it has
    none (the reference path: max_kernel_rows 0)."""
    rows = torch.zeros(100, 8)
    assert not fits_row_kernel(rows, 64)
    with row_kernels_up_to(128):
        assert fits_row_kernel(rows, 64) and not fits_row_kernel(rows, 0)
        assert not fits_row_kernel(torch.zeros(129, 8), 64)
    assert not fits_row_kernel(rows, 64)


def test_group_size_is_the_row_budget_over_the_run_length(reference_model, cpu_kernel_model):
    engine = new_engine(reference_model)  # 128 rows, 4 slots
    assert [engine.prefill_group_size(t) for t in RUN_TOKENS] == [4, 4, 2]
    slot = engine.open_sequence()
    assert engine.shares_prefills(slot, 40)  # run length 64: two share a forward
    assert not engine.shares_prefills(slot, 65)  # no run length: chunked, alone
    engine.prefill(slot, [1, 2, 3])
    assert not engine.shares_prefills(slot, 5)  # not from position 0
    # By default the rows the row-independent kernels take: none on the reference path.
    assert new_engine(reference_model, prefill_batch_rows=None).prefill_group_size(16) == 1
    kernel_engine = new_engine(cpu_kernel_model, prefill_batch_rows=None)
    assert [kernel_engine.prefill_group_size(t) for t in RUN_TOKENS] == [4, 2, 1]


@pytest.mark.parametrize(
    "case",
    ["different run lengths", "continued prompt", "too many", "same slot", "bad token"],
)
def test_prefill_together_refuses_what_cannot_share_a_forward(reference_model, case):
    engine = new_engine(reference_model)
    slots = [engine.open_sequence() for _ in range(3)]
    prompts = [[1, 2, 3] * 6, [4, 5] * 9]
    if case == "different run lengths":
        prompts[1] = [4] * 40
    elif case == "continued prompt":
        engine.prefill(slots[1], [9, 9])
    elif case == "too many":
        engine = new_engine(reference_model, prefill_batch_rows=32)  # one 32-token prompt
        slots = [engine.open_sequence() for _ in range(2)]
    elif case == "same slot":
        slots[1] = slots[0]
    else:
        prompts[1] = [4, reference_model.config.vocab_size]
    before = [engine.length(slot) for slot in slots[:2]]
    with pytest.raises(InvalidRequestError):
        engine.prefill_together(slots[:2], prompts)
    assert [engine.length(slot) for slot in slots[:2]] == before


def fail_after_the_forward(monkeypatch, error: Exception):
    """The padded forward runs (and writes the slots' state), then raises `error`."""
    forward = prefill_graphs.padded_prefill

    def failing(*args):
        forward(*args)
        raise error

    monkeypatch.setattr(prefill_graphs, "padded_prefill", failing)


def assert_empty(engine, slots):
    """Nothing committed: no length, and the GDN state a next prefill starts from is zero."""
    for slot in slots:
        assert engine.length(slot) == 0
        assert not engine.state.recurrent_state[:, slot].any()
        assert not engine.state.conv_state[:, slot].any()


def test_a_failed_forward_leaves_no_prompt_committed(reference_model, monkeypatch):
    engine = new_engine(reference_model)
    slots = [engine.open_sequence() for _ in range(2)]
    fail_after_the_forward(monkeypatch, RuntimeError("injected failure"))
    with pytest.raises(RuntimeError, match="injected"):
        engine.prefill_together(slots, list(PROMPTS[:2]))
    assert_empty(engine, slots)


def test_a_failed_prefill_fails_only_its_prompts_in_a_batch(reference_model, monkeypatch):
    """The batch function runs a verify and two prompts: with the prompts' forward failing,
    the verify still commits and the prompts get the error, nothing of them committed."""
    engine = new_engine(reference_model)
    decoding, first, second = (engine.open_sequence() for _ in range(3))
    engine.prefill(decoding, PROMPTS[2])
    fail_after_the_forward(monkeypatch, ZeroDivisionError())
    greedy_params = SamplingParams()
    requests = [
        PrefillRequest(first, PROMPTS[0], greedy_params),
        VerifyRequest(decoding, [7, 8], greedy_params),
        PrefillRequest(second, PROMPTS[1], greedy_params),
    ]
    results = run_target_batch(engine, requests)
    assert isinstance(results[0], ZeroDivisionError) and results[2] is results[0]
    assert_empty(engine, [first, second])
    kept = len(results[1].token_ids)
    assert kept and engine.length(decoding) == len(PROMPTS[2]) + kept


def test_a_failed_verify_fails_only_the_blocks_in_a_batch(reference_model, monkeypatch):
    """The prompts are committed before the blocks are verified: a failing verify gives its
    error to the blocks, and the prompts their steps."""
    engine = new_engine(reference_model)
    decoding, first = engine.open_sequence(), engine.open_sequence()
    engine.prefill(decoding, PROMPTS[2])

    def failing(slots, blocks):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(engine, "verify", failing)
    greedy_params = SamplingParams()
    requests = [
        PrefillRequest(first, PROMPTS[0], greedy_params),
        VerifyRequest(decoding, [7, 8], greedy_params),
    ]
    prefill_step, verify_error = run_target_batch(engine, requests)
    assert isinstance(verify_error, RuntimeError)
    assert engine.length(first) == len(PROMPTS[0]) and prefill_step.token_ids


def test_a_failed_choice_after_the_forward_resets_the_prompts(reference_model, monkeypatch):
    """Choosing the first tokens is where an asynchronous GPU error of the forward surfaces:
    if it fails, the committed prompts are reset."""
    engine = new_engine(reference_model)
    slots = [engine.open_sequence() for _ in range(2)]

    def failing(*args):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(speculative_step, "choose_block_tokens", failing)
    requests = [
        PrefillRequest(s, p, SamplingParams()) for s, p in zip(slots, PROMPTS, strict=False)
    ]
    results = run_target_batch(engine, requests)
    assert all(isinstance(result, RuntimeError) for result in results)
    assert_empty(engine, slots)


def test_sessions_starting_together_share_prefill_forwards(reference_model, monkeypatch):
    """Three sessions of run length 32 share one forward; a 40-token prompt (run length 64)
    in the same batch runs in its own; a bad prompt gets its error and the others are served.
    Each step equals `prefill_and_choose` alone, and so does the next verify."""
    engine = new_engine(reference_model, max_slots=5)
    target = InProcessTarget(engine, max_wait_us=LONG_WAIT_US)
    vocab = reference_model.config.vocab_size
    prompts = [*PROMPTS, [2] * 40, [2] * 5 + [vocab]]
    forwards = record_padded_forwards(monkeypatch)

    async def start_all():
        sessions = [await target.open(SamplingParams()) for _ in prompts]
        steps = await asyncio.gather(
            *(s.prefill(p) for s, p in zip(sessions, prompts, strict=True)),
            return_exceptions=True,
        )
        served = zip(sessions[:4], steps[:4], strict=True)
        after = [await s.verify([step.token_ids[0]]) for s, step in served]
        return steps, after

    try:
        steps, after = asyncio.run(start_all())
    finally:
        target.close()
    assert isinstance(steps[4], InvalidRequestError)
    assert forwards == [(3, 32), (1, 64)]
    assert target.batcher.counters.max_batch_size_seen == 5
    monkeypatch.undo()
    for prompt, step, next_step in zip(prompts[:4], steps[:4], after, strict=True):
        alone = new_engine(reference_model, prefill_batch_rows=0)
        slot = alone.open_sequence()
        expected = prefill_and_choose(alone, slot, prompt, SamplingParams())
        assert step.token_ids == expected.token_ids and step.num_accepted == 0
        assert step.batch_size == (3 if len(prompt) <= 32 else 1)
        assert torch.equal(step.features, expected.features)
        greedy_next = greedy_tokens(alone, slot, expected.token_ids[0], 1)[1]
        assert next_step.token_ids == [greedy_next]


async def open_then_prefill(target, prompt, round_trip_s):
    """A client: open a session, then send its prompt `round_trip_s` after the open returns."""
    session = await target.open(SamplingParams())
    await asyncio.sleep(round_trip_s)
    return await session.prefill(prompt)


def test_sessions_opening_together_share_a_prefill_forward(reference_model, monkeypatch):
    """Three clients open at once and each sends its prompt when its open returns, the
    later two after a round trip of 20 ms: the first prompt waits for the sessions that are
    opening (not just for those already sending), so all three share one forward."""
    engine = new_engine(reference_model)
    target = InProcessTarget(engine, max_wait_us=LONG_WAIT_US)
    forwards = record_padded_forwards(monkeypatch)

    async def start_all():
        clients = (open_then_prefill(target, p, 0.02 * (i > 0)) for i, p in enumerate(PROMPTS))
        return await asyncio.wait_for(asyncio.gather(*clients), 30)

    try:
        steps = asyncio.run(start_all())
    finally:
        target.close()
    assert forwards == [(3, 32)]
    assert [step.batch_size for step in steps] == [3, 3, 3]


def test_a_long_prompt_of_a_session_opening_alongside_goes_after_the_short_one(
    reference_model, monkeypatch
):
    """Two sessions open at once; the first sends a short prompt (it waits for the other,
    just opened), the second a prompt too long to share a forward: the short prompt's
    forward runs first, not queued behind the long prefill on the engine thread."""
    engine = new_engine(reference_model)
    target = InProcessTarget(engine, max_wait_us=LONG_WAIT_US)
    order = []
    alone = session_module.prefill_and_choose
    monkeypatch.setattr(
        session_module,
        "prefill_and_choose",
        lambda *args: order.append("long") or alone(*args),
    )
    shared = prefill_graphs.padded_prefill
    monkeypatch.setattr(
        prefill_graphs, "padded_prefill", lambda *args: order.append("short") or shared(*args)
    )
    long_prompt = [3] * (max(RUN_TOKENS) + 6)
    assert not engine.shares_prefills(0, len(long_prompt))

    async def start_both():
        clients = (
            open_then_prefill(target, PROMPTS[0], 0),
            open_then_prefill(target, long_prompt, 0.05),
        )
        return await asyncio.wait_for(asyncio.gather(*clients), 30)

    try:
        asyncio.run(start_both())
    finally:
        target.close()
    assert order == ["short", "long"]


def test_sampled_prompts_choose_their_first_token_as_alone(reference_model):
    """Prompts with different sampling settings in one forward: each first token as
    `prefill_and_choose` alone draws it (its own seed, its own position)."""
    engine = new_engine(reference_model)
    slots = [engine.open_sequence() for _ in PROMPTS]
    params = [SamplingParams(temperature=0.8, seed=11 + i) for i in range(2)] + [SamplingParams()]
    requests = [PrefillRequest(s, p, q) for s, p, q in zip(slots, PROMPTS, params, strict=True)]
    steps = run_target_batch(engine, requests)
    for prompt, param, step in zip(PROMPTS, params, steps, strict=True):
        alone = new_engine(reference_model, prefill_batch_rows=0)
        expected = prefill_and_choose(alone, alone.open_sequence(), prompt, param)
        assert step.token_ids == expected.token_ids
