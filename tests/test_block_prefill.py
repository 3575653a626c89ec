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
LONG_WAIT_US = 2_000_000  # the sessions' first blocks must meet in one batch


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


def test_longer_prompts_prefill_in_chunks(model):
    prompt = PROMPTS[1]  # 33 tokens
    blocked, chunked = new_engine(model, 32), new_engine(model, 0)
    results = [engine.prefill(engine.open_sequence(), prompt) for engine in (blocked, chunked)]
    assert torch.equal(results[0].last_logits, results[1].last_logits)
    assert torch.equal(results[0].taps, results[1].taps)
