"""Short prompts prefilled as verify blocks, committed whole (the GPU default: the blocks replay
the verify graph, and concurrent sessions' prompts share verifies).

Checked bit for bit on the CPU against an independent reference: an engine verifying the
prompt's 16-token blocks one by one and committing each whole. Rows do not depend on how many
sequences share a forward (tests/test_recoverable_state.py), so batched prefills equal it.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from dflash_serve.errors import InvalidRequestError
from dflash_serve.speculative.types import SamplingParams
from target_service.engine import TargetEngine
from target_service.model.loader import load_target_model
from target_service.model.state import StateShape
from target_service.session import InProcessTarget

TAP = 2
PROMPTS = ([5 + i % 90 for i in range(20)], [7 * i % 97 + 1 for i in range(33)], list(range(16)))
LONG_WAIT_US = 500_000  # the sessions' first blocks must meet in one batch


@pytest.fixture(scope="module")
def model(causal_lm_dir):
    return load_target_model(causal_lm_dir)


def new_engine(model, block_prefill_max_tokens):
    shape = StateShape(max_slots=4, max_len=256)
    return TargetEngine(model, shape, (TAP,), block_prefill_max_tokens=block_prefill_max_tokens)


def reference_prefill(model, prompt):
    """The prompt's blocks verified one by one on a fresh engine, each committed whole."""
    engine = new_engine(model, 0)
    slot = engine.open_sequence()
    taps = []
    for start in range(0, len(prompt), 16):
        block = prompt[start : start + 16]
        result = engine.verify([slot], [block])
        engine.commit(slot, len(block))
        taps.append(result.taps[0])
    return engine, slot, int(result.logits[0, -1].argmax()), torch.cat(taps)


def decode_tokens(engine, slot, token, count):
    """Greedy plain decoding from `token`: the next `count` tokens."""
    out = []
    for _ in range(count):
        token = int(engine.verify([slot], [[token]]).logits[0, 0].argmax())
        engine.commit(slot, 1)
        out.append(token)
    return out


def test_engine_prefills_short_prompts_as_committed_blocks(model):
    for prompt in PROMPTS:
        engine = new_engine(model, 40)
        slot = engine.open_sequence()
        result = engine.prefill(slot, prompt)
        ref_engine, ref_slot, ref_token, ref_taps = reference_prefill(model, prompt)
        assert int(result.last_logits.argmax()) == ref_token
        assert torch.equal(result.taps, ref_taps)
        assert engine.length(slot) == len(prompt)
        assert decode_tokens(engine, slot, ref_token, 4) == decode_tokens(
            ref_engine, ref_slot, ref_token, 4
        )


def test_sessions_starting_together_share_prompt_block_verifies(model):
    engine = new_engine(model, 40)
    target = InProcessTarget(engine, max_wait_us=LONG_WAIT_US)

    async def prefill_all():
        sessions = [await target.open(SamplingParams()) for _ in PROMPTS]
        steps = await asyncio.gather(
            *(session.prefill(prompt) for session, prompt in zip(sessions, PROMPTS, strict=True))
        )
        after = [
            await session.verify([step.token_ids[0]])
            for session, step in zip(sessions, steps, strict=True)
        ]
        return steps, after

    try:
        steps, after = asyncio.run(prefill_all())
    finally:
        target.close()
    # The three first blocks ran as one verify.
    assert target.batcher.counters.max_batch_size_seen == 3
    for prompt, step, next_step in zip(PROMPTS, steps, after, strict=True):
        ref_engine, ref_slot, ref_token, ref_taps = reference_prefill(model, prompt)
        assert step.token_ids == [ref_token] and step.num_accepted == 0
        assert torch.equal(step.features, ref_taps)
        assert next_step.token_ids == decode_tokens(ref_engine, ref_slot, ref_token, 1)


def test_a_bad_short_prompt_is_refused_before_any_block_is_committed(model):
    engine = new_engine(model, 40)
    target = InProcessTarget(engine)
    vocab = model.config.vocab_size

    async def prefill_bad():
        session = await target.open(SamplingParams())
        with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
            await session.prefill([*range(30), vocab])  # the bad id is in block 2
        return session.slot

    try:
        slot = asyncio.run(prefill_bad())
    finally:
        target.close()
    assert engine.length(slot) == 0


def count_verifies(engine):
    """Wrap engine.verify (the block path calls it, the chunked path never does)."""
    calls = []
    verify = engine.verify

    def counting(slots, blocks):
        calls.append([len(block) for block in blocks])
        return verify(slots, blocks)

    engine.verify = counting
    return calls


def test_prompts_up_to_the_limit_run_as_blocks_longer_ones_in_chunks(model):
    prompt = PROMPTS[1]  # 33 tokens: blocks of 16, 16, 1
    at_limit, below = new_engine(model, len(prompt)), new_engine(model, len(prompt) - 1)
    calls = {engine: count_verifies(engine) for engine in (at_limit, below)}
    results = {engine: engine.prefill(engine.open_sequence(), prompt) for engine in calls}
    assert calls[at_limit] == [[16], [16], [1]]
    assert calls[below] == []
    plain = new_engine(model, 0)
    reference = plain.prefill(plain.open_sequence(), prompt)
    assert torch.equal(results[below].last_logits, reference.last_logits)
    assert torch.equal(results[below].taps, reference.taps)


def test_a_prefill_failing_part_way_leaves_nothing_committed(model):
    """The second block's verify fails: the slot is empty again and a retry gives the
    result of a clean prefill (engine and batched session alike)."""
    prompt = PROMPTS[0]
    _, _, ref_token, ref_taps = reference_prefill(model, prompt)
    engine = new_engine(model, 40)
    verify, invocations = engine.verify, []

    def failing_second(slots, blocks):
        """Fails the second verify after `invocations` is cleared, once."""
        invocations.append(len(blocks[0]))
        if len(invocations) == 2:
            raise RuntimeError("injected failure")
        return verify(slots, blocks)

    engine.verify = failing_second
    slot = engine.open_sequence()
    with pytest.raises(RuntimeError, match="injected"):
        engine.prefill(slot, prompt)
    assert engine.length(slot) == 0
    retry = engine.prefill(slot, prompt)
    assert int(retry.last_logits.argmax()) == ref_token and torch.equal(retry.taps, ref_taps)

    engine.close_sequence(slot)
    invocations.clear()
    target = InProcessTarget(engine)

    async def session_prefill_twice():
        session = await target.open(SamplingParams())
        with pytest.raises(RuntimeError, match="injected"):
            await session.prefill(prompt)
        assert engine.length(session.slot) == 0
        return await session.prefill(prompt)

    try:
        step = asyncio.run(session_prefill_twice())
    finally:
        target.close()
    assert step.token_ids == [ref_token] and torch.equal(step.features, ref_taps)
