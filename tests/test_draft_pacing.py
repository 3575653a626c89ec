"""DraftPacing: back off while drafting does not pay, resume as soon as it does."""

from __future__ import annotations

import asyncio

import pytest

from dflash_serve.speculative.loop import SpeculativeGeneration, StopRules
from dflash_serve.speculative.pacing import DraftPacing, StepCosts
from dflash_serve.speculative.types import TargetStep


def run(
    pacing: DraftPacing,
    accepted_when_drafted: list[int],
    drafted_s: float | None = None,
    plain_s: float | None = None,
) -> str:
    """'D' for a drafted step (taking the next outcome), '.' for a skipped one; steps take
    drafted_s / plain_s seconds (None: untimed)."""
    trace, outcomes = [], iter(accepted_when_drafted)
    while True:
        if pacing.should_draft():
            try:
                accepted = next(outcomes)
            except StopIteration:
                return "".join(trace)
            trace.append("D")
            pacing.record(15, accepted, drafted_s)
        else:
            trace.append(".")
            pacing.record(0, 0, plain_s)


def test_backoff_doubles_up_to_the_cap_after_two_misses():
    trace = run(DraftPacing(max_skipped_steps=8), [0] * 8)
    assert trace == "DD.D..D....D" + "........D" * 3 + "........"


def test_an_accepted_draft_restores_drafting_every_step():
    trace = run(DraftPacing(), [0, 0, 0, 3, 1, 0, 2])
    assert trace == "DD.D..DDDD"


def test_a_miss_between_accepts_does_not_back_off():
    assert run(DraftPacing(), [1, 0, 1, 0, 1]) == "DDDDD"


def test_step_costs_break_even_needs_both_kinds_of_step():
    costs = StepCosts(smoothing=0.5)
    assert costs.break_even_tokens() is None
    costs.record(True, 3.0)
    assert costs.break_even_tokens() is None
    costs.record(False, 1.0)
    assert costs.break_even_tokens() == 3.0
    costs.record(True, 1.0)  # 3 + 0.5 * (1 - 3)
    assert costs.drafted_s == 2.0 and costs.break_even_tokens() == 2.0


def test_drafting_that_yields_below_break_even_backs_off():
    """Each drafted step costs 3 plain steps and yields 2 tokens: not worth it, although
    every step accepts a draft (pacing on misses alone would draft at every step)."""
    costs = StepCosts()
    costs.record(False, 1.0)
    trace = run(DraftPacing(costs), [1] * 8, drafted_s=3.0, plain_s=1.0)
    assert trace == "DD.D..D....D" + "........D" * 3 + "........"
    assert run(DraftPacing(), [1] * 8) == "D" * 8


def test_drafting_above_break_even_continues_and_a_good_probe_resumes_it():
    costs = StepCosts()
    costs.record(False, 1.0)
    assert run(DraftPacing(costs), [4] * 6, drafted_s=3.0, plain_s=1.0) == "D" * 6
    # Two poor steps back off; one probe yielding 11 tokens lifts the smoothed yield
    # (0.5 weight) above the break-even of 3 and restores drafting at every step.
    assert run(DraftPacing(costs), [0, 0, 10, 3, 3], drafted_s=3.0, plain_s=1.0) == "DD.DDD"


def test_one_plain_step_is_timed_when_no_plain_cost_is_known():
    costs = StepCosts()
    trace = run(DraftPacing(costs), [5] * 7, drafted_s=2.0, plain_s=1.0)
    assert trace == "DDDD.DDD"
    assert costs.break_even_tokens() == 2.0
    # Another request sharing the costs needs no sample of its own.
    assert run(DraftPacing(costs), [5] * 6, drafted_s=2.0, plain_s=1.0) == "D" * 6


class ScriptedTarget:
    """Accepts `accepted[i]` drafts at step i; emits distinct token ids."""

    def __init__(self, accepted: list[int]) -> None:
        self.accepted = iter(accepted)
        self.next_id = 100

    def _tokens(self, count: int) -> list[int]:
        self.next_id += count
        return list(range(self.next_id - count, self.next_id))

    async def prefill(self, prompt_ids):
        return TargetStep(self._tokens(1), 0, None, 0)

    async def verify(self, block_ids):
        accepted = min(next(self.accepted, 0), len(block_ids) - 1)
        return TargetStep(self._tokens(accepted + 1), accepted, None, 0)


class FixedDrafter:
    async def draft(self, features, anchor_id, num_drafts):
        return [1] * num_drafts


class RecordingPacing(DraftPacing):
    def __init__(self) -> None:
        super().__init__()
        self.records = []

    def record(self, num_drafted, num_accepted, seconds=None):
        self.records.append((num_drafted, num_accepted, seconds))
        super().record(num_drafted, num_accepted, seconds)


def test_loop_times_every_step_but_the_first():
    ticks = iter(range(0, 1000, 5))  # each clock reading 5 s after the one before
    pacing = RecordingPacing()
    run = SpeculativeGeneration(
        ScriptedTarget([2, 0, 3]),
        FixedDrafter(),
        [1, 2, 3],
        StopRules(9),
        15,
        4096,
        pacing,
        clock=lambda: float(next(ticks)),
    )

    async def collect():
        return [token async for token in run.tokens()]

    assert len(asyncio.run(collect())) == 9
    assert [seconds for _, _, seconds in pacing.records] == [None, 5.0, 5.0]
    # Drafts asked: as many as may still follow the anchor (9 new tokens: 1, 4, 5 emitted).
    assert [(drafted, accepted) for drafted, accepted, _ in pacing.records] == [
        (7, 2),
        (4, 0),
        (3, 3),
    ]


@pytest.mark.parametrize("smoothing", [0.0, 1.0])
def test_step_costs_smoothing_bounds(smoothing):
    costs = StepCosts(smoothing=smoothing)
    costs.record(False, 2.0)
    costs.record(False, 4.0)
    assert costs.plain_s == (2.0 if smoothing == 0.0 else 4.0)
