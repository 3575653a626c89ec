"""DraftPacing: back off after repeated misses, resume drafting at the first acceptance."""

from __future__ import annotations

from dflash_serve.speculative.pacing import DraftPacing


def run(pacing: DraftPacing, accepted_when_drafted: list[int]) -> str:
    """'D' for a drafted step (taking the next outcome), '.' for a skipped one."""
    trace, outcomes = [], iter(accepted_when_drafted)
    while True:
        if pacing.should_draft():
            try:
                accepted = next(outcomes)
            except StopIteration:
                return "".join(trace)
            trace.append("D")
            pacing.record(15, accepted)
        else:
            trace.append(".")
            pacing.record(0, 0)


def test_backoff_doubles_up_to_the_cap_after_two_misses():
    trace = run(DraftPacing(max_skipped_steps=8), [0] * 8)
    assert trace == "DD.D..D....D" + "........D" * 3 + "........"


def test_an_accepted_draft_restores_drafting_every_step():
    trace = run(DraftPacing(), [0, 0, 0, 3, 1, 0, 2])
    assert trace == "DD.D..DDDD"


def test_a_miss_between_accepts_does_not_back_off():
    assert run(DraftPacing(), [1, 0, 1, 0, 1]) == "DDDDD"
