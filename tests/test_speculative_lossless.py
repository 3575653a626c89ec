"""Speculative output equals target-only output, token for token, for any drafter.

Drafters: the real DFlash drafter with random weights (acceptance near 0), the scripted
drafter at full acceptance, and scripted patterns covering every count 0..K, for K in
{1, 7, 15}; greedy and seeded sampling at T 0.7 and 1.0; one sequence at a time and many
stepped together in one batch.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest

from dflash_serve.speculative.pacing import DraftPacing
from dflash_serve.speculative.scripted_drafter import ScriptedDrafter
from dflash_serve.speculative.types import SamplingParams
from drafter_service.engine import DrafterEngine
from drafter_service.model.loader import load_drafter
from drafter_service.session import InProcessDrafter
from target_service.engine import TargetEngine
from target_service.model.loader import load_target_model
from target_service.model.state import StateShape
from target_service.session import InProcessTarget
from tests.speculative_harness import generate

PROMPTS = [[5, 17, 33, 2, 99], [7] * 12, [120, 3, 44, 61, 12, 150, 8, 9, 10, 11, 12, 13, 140]]
SEEDS = [0, 1234, 2**40 + 7]
TEMPERATURES = [0.0, 0.7, 1.0]
MAX_NEW = 40
FULL = [15]
EVERY_COUNT = list(range(16))


@pytest.fixture(scope="module")
def services(causal_lm_dir, dflash_dir):
    model = load_target_model(causal_lm_dir)
    taps = load_drafter(dflash_dir, causal_lm_dir).config.target_layer_ids
    target_engine = TargetEngine(model, StateShape(max_slots=8, max_len=256), taps)
    drafter_engine = DrafterEngine(load_drafter(dflash_dir, causal_lm_dir), 8, 256)
    target, drafter = InProcessTarget(target_engine), InProcessDrafter(drafter_engine)
    yield target, drafter
    target.close()
    drafter.close()


def sampling_for(seed, temperature):
    return SamplingParams(temperature=temperature, top_p=0.95, top_k=50, seed=seed)


@pytest.mark.parametrize(
    ("prompt", "seed", "temperature"), list(itertools.product(PROMPTS, SEEDS, TEMPERATURES))
)
def test_speculative_equals_target_only(services, prompt, seed, temperature):
    target, drafter = services
    sampling = sampling_for(seed, temperature)
    vocab = target.engine.config.vocab_size

    async def run_all():
        reference = await generate(target, None, prompt, sampling, MAX_NEW, 15)
        expected = reference[0]
        runs = {
            "dflash-random K=15": (await drafter.open(), 15),
            "scripted full K=15": (ScriptedDrafter(expected, FULL, vocab), 15),
            "scripted 0..15 K=15": (ScriptedDrafter(expected, EVERY_COUNT, vocab), 15),
            "scripted 0..7 K=7": (ScriptedDrafter(expected, EVERY_COUNT[:8], vocab), 7),
            "scripted 0..1 K=1": (ScriptedDrafter(expected, [1, 0, 1], vocab), 1),
        }
        outcomes = {}
        for name, (session, num_drafts) in runs.items():
            outcomes[name] = await generate(target, session, prompt, sampling, MAX_NEW, num_drafts)
        return reference, outcomes

    reference, outcomes = asyncio.run(run_all())
    tokens, finish_reason, _ = reference
    assert len(tokens) == MAX_NEW or finish_reason == "stop"
    for name, (spec_tokens, spec_finish, _) in outcomes.items():
        assert spec_tokens == tokens, name
        assert spec_finish == finish_reason, name
    full = outcomes["scripted full K=15"][2]
    if len(tokens) > 17:
        assert full.num_accepted_tokens >= 15, "full acceptance was not exercised"
    mixed = outcomes["scripted 0..15 K=15"][2]
    assert mixed.num_drafts >= 3


def test_every_acceptance_count_is_exercised(services):
    """The 0..15 pattern over a long generation accepts every count from 0 to 15."""
    target, _ = services
    sampling = sampling_for(0, 0.0)
    vocab = target.engine.config.vocab_size

    async def run():
        expected, _, _ = await generate(target, None, PROMPTS[0], sampling, 150, 15)
        seen = []
        drafter = ScriptedDrafter(expected, EVERY_COUNT, vocab)
        original = target.batcher._run_batch

        def spy(requests):
            results = original(requests)
            seen.extend(r.num_accepted for r in results)
            return results

        target.batcher._run_batch = spy
        try:
            tokens, _, _ = await generate(target, drafter, PROMPTS[0], sampling, 150, 15)
        finally:
            target.batcher._run_batch = original
        return expected, tokens, seen

    expected, tokens, seen = asyncio.run(run())
    assert tokens == expected
    if len(expected) == 150:
        assert set(seen) >= set(range(16))


def test_batched_sequences_each_get_their_solo_output(services):
    target, drafter = services
    cases = [
        (prompt, sampling_for(seed, t))
        for prompt, seed, t in zip(
            PROMPTS * 2, SEEDS * 2, [0.0, 0.7, 1.0, 1.0, 0.0, 0.7], strict=True
        )
    ]

    async def run():
        solo = [await generate(target, None, p, s, MAX_NEW, 15) for p, s in cases]
        before = target.batcher.counters.max_batch_size_seen
        target.batcher.counters.max_batch_size_seen = 0
        vocab = target.engine.config.vocab_size
        sessions = []
        for i, (expected, _, _) in enumerate(solo):
            if i % 2:
                sessions.append(await drafter.open())
            else:
                sessions.append(ScriptedDrafter(expected, EVERY_COUNT[i:], vocab))
        together = await asyncio.gather(
            *(
                generate(target, d, p, s, MAX_NEW, 15)
                for d, (p, s) in zip(sessions, cases, strict=True)
            )
        )
        seen = target.batcher.counters.max_batch_size_seen
        target.batcher.counters.max_batch_size_seen = max(before, seen)
        return solo, together, seen

    solo, together, max_batch = asyncio.run(run())
    for (expected, _, _), (tokens, _, _) in zip(solo, together, strict=True):
        assert tokens == expected
    assert max_batch > 1, "concurrent verify steps were not batched"


class RecordingDrafter:
    """Passes draft calls to a real session; records (context rows so far, anchor, drafts
    asked) per call."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.num_rows = 0
        self.calls: list[tuple[int, int, int]] = []

    async def draft(self, features, anchor_id: int, num_drafts: int) -> list[int]:
        self.num_rows += features.shape[0]
        self.calls.append((self.num_rows, anchor_id, num_drafts))
        return await self.inner.draft(features, anchor_id, num_drafts)

    async def close(self) -> None:
        await self.inner.close()


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_paced_drafting_is_lossless_and_feeds_every_step(services, temperature):
    """With drafts rejected, pacing skips drafting on some steps; output is unchanged and
    the drafter still receives the features of every committed token, step by step."""
    target, drafter = services
    sampling = sampling_for(7, temperature)

    async def run():
        reference, _, _ = await generate(target, None, PROMPTS[2], sampling, MAX_NEW, 15)
        paced = RecordingDrafter(await drafter.open())
        tokens, _, stats = await generate(
            target, paced, PROMPTS[2], sampling, MAX_NEW, 15, DraftPacing()
        )
        return reference, tokens, stats, paced.calls

    reference, tokens, stats, calls = asyncio.run(run())
    assert tokens == reference
    # Each call's anchor is the token right after all context rows given so far: no step's
    # features were skipped or given twice.
    sequence = PROMPTS[2] + reference
    assert all(sequence[rows] == anchor for rows, anchor, _ in calls)
    assert calls[-1][0] >= len(sequence) - 16
    assert any(asked == 0 for _, _, asked in calls), "pacing never skipped a draft"
    assert stats.num_drafts < stats.num_target_steps
