"""When to draft: back off while drafting does not pay, resume as soon as it does.

A drafted step costs a drafter forward and a 16-token verify; when the drafter cannot
predict the target (a prompt unlike its training, say) that cost buys nothing, and
speculative decoding becomes slower than the target alone. Drafting pays while a drafted
step's tokens (accepted drafts + 1) outnumber the plain steps its time would have bought:
the break-even is the drafted step's cost over a plain step's (`StepCosts`, measured on the
requests that share it). While it is not known (no plain step timed yet), a drafted step
misses when nothing is accepted.

After two drafted steps in a row that miss (the smoothed tokens per drafted step below the
break-even), the loop skips drafting for 1, 2, 4, then at most `max_skipped_steps` steps
between probes; a probe that brings the smoothed yield back above the break-even restores
drafting every step. Skipped steps still hand the drafter the committed tokens' features,
so its context stays complete, and the output is the target's either way.
"""

from __future__ import annotations

from dataclasses import dataclass

MISSES_BEFORE_BACKOFF = 2
# Drafted steps of a request before it times one plain step, while none has been timed.
DRAFTED_STEPS_BEFORE_PLAIN_SAMPLE = 4


@dataclass
class StepCosts:
    """Smoothed wall times of drafted and plain steps, in seconds. One per deployment (the
    costs are the hardware's and the models', not a request's), shared by its requests'
    DraftPacing; they change with the load, so recent steps weigh most."""

    smoothing: float = 0.2
    drafted_s: float | None = None
    plain_s: float | None = None

    def record(self, is_drafted: bool, seconds: float) -> None:
        name = "drafted_s" if is_drafted else "plain_s"
        mean = getattr(self, name)
        setattr(self, name, seconds if mean is None else mean + self.smoothing * (seconds - mean))

    def break_even_tokens(self) -> float | None:
        """Tokens a drafted step must yield to be as fast as plain steps; None until both
        kinds of step have been timed."""
        if self.drafted_s is None or self.plain_s is None or self.plain_s <= 0:
            return None
        return self.drafted_s / self.plain_s


@dataclass
class DraftPacing:
    costs: StepCosts | None = None  # None: a drafted step misses only when nothing is accepted
    max_skipped_steps: int = 8
    yield_smoothing: float = 0.5
    num_misses: int = 0  # drafted steps in a row that missed
    num_to_skip: int = 0  # steps left before the next probe
    mean_yield: float | None = None  # tokens per drafted step (accepted + 1), smoothed
    num_drafted: int = 0
    has_timed_plain: bool = False

    def should_draft(self) -> bool:
        if self.num_to_skip > 0:
            self.num_to_skip -= 1
            return False
        if (  # time one plain step, once, so that the break-even becomes known
            self.costs is not None
            and self.costs.plain_s is None
            and not self.has_timed_plain
            and self.num_drafted >= DRAFTED_STEPS_BEFORE_PLAIN_SAMPLE
        ):
            self.has_timed_plain = True
            return False
        return True

    def record(self, num_drafted: int, num_accepted: int, seconds: float | None = None) -> None:
        """seconds: the step's wall time (draft + verify), None when it should not count
        (a request's first step also brings the prompt's context to the drafter)."""
        if seconds is not None and self.costs is not None:
            self.costs.record(num_drafted > 0, seconds)
        if num_drafted == 0:
            return
        self.num_drafted += 1
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
        if break_even is None:
            return num_accepted > 0
        return self.mean_yield >= break_even
