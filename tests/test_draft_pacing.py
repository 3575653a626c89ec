"""DraftPacing: back off while drafting does not pay, resume as soon as it does."""

from __future__ import annotations

import asyncio

from dflash_serve.speculative.loop import SpeculativeGeneration, StopRules
from dflash_serve.speculative.pacing import (
    DRAFTED_STEPS_BEFORE_FIRST_PLAIN,
    DRAFTED_STEPS_BETWEEN_PLAIN,
    RECENT_STEPS,
    DraftPacing,
    StepCosts,
)
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
    costs = StepCosts()
    assert costs.break_even_tokens() is None
    costs.record(True, 3.0)
    assert costs.break_even_tokens() is None
    costs.record(False, 1.0)
    assert costs.break_even_tokens() == 3.0
    costs.record(True, 1.0)  # median of 3 and 1
    assert costs.break_even_tokens() == 2.0


def test_a_step_that_waited_behind_a_prefill_does_not_move_the_costs():
    costs = StepCosts()
    for seconds in (1.0, 1.0, 300.0):
        costs.record(False, seconds)
    costs.record(True, 3.0)
    assert costs.break_even_tokens() == 3.0
    for _ in range(RECENT_STEPS):  # the load changed: only recent steps count
        costs.record(False, 2.0)
    assert costs.break_even_tokens() == 1.5


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


def test_nothing_accepted_is_a_miss_even_below_a_break_even_of_one():
    """A drafted step faster than a plain one (break-even 0.5) still misses when it yields
    only the target's own token, as a plain step would."""
    costs = StepCosts()
    costs.record(False, 2.0)
    assert run(DraftPacing(costs), [0] * 3, drafted_s=1.0, plain_s=2.0) == "DD.D.."


def test_plain_steps_are_timed_again_while_drafting_pays():
    costs = StepCosts()
    costs.record(False, 1.0)
    trace = run(DraftPacing(costs), [5] * 70, drafted_s=2.0, plain_s=1.0)
    assert trace == "D" * DRAFTED_STEPS_BETWEEN_PLAIN + "." + "D" * 6


def test_a_plain_sample_lost_with_its_request_is_handed_out_again():
    costs = StepCosts()
    for _ in range(DRAFTED_STEPS_BEFORE_FIRST_PLAIN):
        costs.record(True, 2.0)
    assert costs.wants_plain_sample() and not costs.wants_plain_sample()
    for _ in range(DRAFTED_STEPS_BEFORE_FIRST_PLAIN):  # that request ended untimed
        costs.record(True, 2.0)
    assert costs.wants_plain_sample()


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


class FailingDrafter:
    def __init__(self, fail_at_call: int) -> None:
        self.calls, self.fail_at_call = 0, fail_at_call

    async def draft(self, features, anchor_id, num_drafts):
        self.calls += 1
        if self.calls == self.fail_at_call:
            raise RuntimeError("drafter down")
        return [1] * num_drafts


def timed_records(drafter, accepted: list[int], max_new: int) -> list:
    ticks = iter(range(0, 1000, 5))
    pacing = RecordingPacing()
    run = SpeculativeGeneration(
        ScriptedTarget(accepted),
        drafter,
        [1, 2, 3],
        StopRules(max_new),
        15,
        4096,
        pacing,
        clock=lambda: float(next(ticks)),
    )

    async def collect():
        return [token async for token in run.tokens()]

    assert len(asyncio.run(collect())) == max_new
    return pacing.records


def test_steps_without_a_working_drafter_are_not_timed():
    """A step whose drafter failed, and the target-only steps after it, cost what no paced-
    out step costs: they must not reach the shared costs."""
    records = timed_records(FailingDrafter(fail_at_call=3), [1, 1, 0, 0], 7)
    assert [seconds for _, _, seconds in records] == [None, 5.0, None, None]
    assert [seconds for _, _, seconds in timed_records(None, [0] * 4, 5)] == [None] * 4


def test_loop_times_every_step_but_the_first():
    records = timed_records(FixedDrafter(), [2, 0, 3], 9)
    assert [seconds for _, _, seconds in records] == [None, 5.0, 5.0]
    # Drafts asked: as many as may still follow the anchor (9 new tokens: 1, 4, 5 emitted).
    assert [(drafted, accepted) for drafted, accepted, _ in records] == [(7, 2), (4, 0), (3, 3)]
