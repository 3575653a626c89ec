"""When to draft: back off while drafting does not pay, resume as soon as it does.

A drafted step costs a drafter forward and a 16-token verify; when the drafter cannot
predict the target (a prompt unlike its training, say) that cost buys nothing, and
speculative decoding becomes slower than the target alone. Drafting pays while a drafted
step's tokens (accepted drafts + 1) outnumber the plain steps its time would have bought:
the break-even is the drafted step's cost over a plain step's (`StepCosts`, timed on the
requests that share it). A drafted step misses when nothing is accepted, or when the
request's smoothed tokens per drafted step are below the break-even.

After two drafted steps in a row that miss, the loop skips drafting for 1, 2, 4, then at
most `max_skipped_steps` steps between probes; a probe that does not miss restores drafting
every step. Skipped steps still hand the drafter the committed tokens' features, so its
context stays complete, and the output is the target's either way. A skipped step is a
plain step, timed; while plain steps are rare (drafting pays), one is skipped on purpose now
and then (`StepCosts.wants_plain_sample`) so that the break-even follows the load.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

MISSES_BEFORE_BACKOFF = 2
# Drafted steps before a plain step is timed on purpose: the first time, and then again.
DRAFTED_STEPS_BEFORE_FIRST_PLAIN = 4
DRAFTED_STEPS_BETWEEN_PLAIN = 64
RECENT_STEPS = 9  # the costs are medians of this many recent steps of each kind


def _recent() -> deque:
    return deque(maxlen=RECENT_STEPS)


@dataclass
class StepCosts:
    """Recent wall times of drafted and plain steps, in seconds. One per deployment (the
    costs are the hardware's and the models', not a request's), shared by its requests'
    DraftPacing. Medians of the last few steps of each kind: they follow the load, and a
    step that waited behind another request's prefill does not move them."""

    drafted: deque = field(default_factory=_recent)
    plain: deque = field(default_factory=_recent)
    drafted_since_plain: int = 0  # since a plain step was recorded or handed out

    def record(self, is_drafted: bool, seconds: float) -> None:
        if is_drafted:
            self.drafted.append(seconds)
            self.drafted_since_plain += 1
        else:
            self.plain.append(seconds)
            self.drafted_since_plain = 0

    def break_even_tokens(self) -> float | None:
        """Tokens a drafted step must yield to be as fast as plain steps; None until both
        kinds of step have been timed."""
        if not self.drafted or not self.plain:
            return None
        plain = statistics.median(self.plain)
        return statistics.median(self.drafted) / plain if plain > 0 else None

    def wants_plain_sample(self) -> bool:
        """Whether the asking request's next step should be plain, to be timed: once per so
        many drafted steps (of any request), counted again from this answer, so a sample
        lost with its request is handed out again later."""
        due = DRAFTED_STEPS_BEFORE_FIRST_PLAIN if not self.plain else DRAFTED_STEPS_BETWEEN_PLAIN
        if self.drafted_since_plain < due:
            return False
        self.drafted_since_plain = 0
        return True


@dataclass
class DraftPacing:
    costs: StepCosts | None = None  # None: a drafted step misses only when nothing is accepted
    max_skipped_steps: int = 8
    yield_smoothing: float = 0.5
    num_misses: int = 0  # drafted steps in a row that missed
    num_to_skip: int = 0  # steps left before the next probe
    mean_yield: float | None = None  # tokens per drafted step (accepted + 1), smoothed

    def should_draft(self) -> bool:
        if self.num_to_skip > 0:
            self.num_to_skip -= 1
            return False
        return self.costs is None or not self.costs.wants_plain_sample()

    def record(self, num_drafted: int, num_accepted: int, seconds: float | None = None) -> None:
        """seconds: the step's wall time (draft + verify), None when it is not a step's
        cost (see SpeculativeGeneration: a first step, one without a working drafter)."""
        if seconds is not None and self.costs is not None:
            self.costs.record(num_drafted > 0, seconds)
        if num_drafted == 0:
            return
        tokens = num_accepted + 1
        mean = self.mean_yield
        self.mean_yield = tokens if mean is None else mean + self.yield_smoothing * (tokens - mean)
        if self._pays(num_accepted):
            self.num_misses = 0
            return
        self.num_misses += 1
        if self.num_misses >= MISSES_BEFORE_BACKOFF:
            backoff = 2 ** (self.num_misses - MISSES_BEFORE_BACKOFF)
            self.num_to_skip = min(backoff, self.max_skipped_steps)

    def _pays(self, num_accepted: int) -> bool:
        break_even = None if self.costs is None else self.costs.break_even_tokens()
        return num_accepted > 0 and (break_even is None or self.mean_yield >= break_even)
