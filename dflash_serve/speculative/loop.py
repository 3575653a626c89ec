"""The speculative loop: prefill → (draft → verify → accept → commit)* until a stop.

Each verify returns the target's own tokens for the block; a draft is accepted iff it
equals the target's token at its position, so every emitted token is the target's token
and the output is exactly target-only decoding. The loop walks the tokens of each step one
by one so that the first stop (stop token, max_new_tokens, context limit) wins and nothing
after it is emitted. A failing drafter only costs speed: the loop continues target-only.
With a DraftPacing, steps may carry no drafts while drafting does not pay (pacing.py).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from dflash_serve.speculative.pacing import DraftPacing
from dflash_serve.speculative.protocols import DrafterSession, TargetSession
from dflash_serve.speculative.types import SpecStats

logger = logging.getLogger(__name__)

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


@dataclass(frozen=True)
class StopRules:
    max_new_tokens: int
    stop_token_ids: frozenset[int] = frozenset()  # EOS ids and the request's own stop ids


@dataclass
class SpeculativeGeneration:
    """One request's run; iterate `steps()` (or `tokens()`) for the emitted ids as they
    are committed."""

    target: TargetSession
    drafter: DrafterSession | None
    prompt_ids: list[int]
    stops: StopRules
    num_drafts: int
    max_context_tokens: int
    pacing: DraftPacing | None = None  # None: draft at every step
    clock: Callable[[], float] = time.perf_counter  # times steps for the pacing
    finish_reason: str | None = None
    stats: SpecStats = field(default_factory=SpecStats)
    drafter_error: BaseException | None = None

    async def tokens(self) -> AsyncIterator[int]:
        """The emitted ids one by one (`steps` gives them a step at a time)."""
        async with contextlib.aclosing(self.steps()) as steps:
            async for step_ids in steps:
                for token in step_ids:
                    yield token

    async def steps(self) -> AsyncIterator[list[int]]:
        """The emitted ids a step at a time: the prefill's token, then each verify's
        tokens up to the first stop. A consumer that handles a step's tokens together
        (one detokenization, one streamed chunk) does per step what it would per token."""
        if self.stops.max_new_tokens < 1:
            self.finish_reason = FINISH_LENGTH
            return
        step = await self.target.prefill(self.prompt_ids)
        num_emitted = 0
        committed = len(self.prompt_ids)
        while True:
            emitted, finish_reason = self._emitted(step.token_ids, num_emitted)
            num_emitted += len(emitted)
            yield emitted
            if finish_reason is not None:  # (set once the consumer has taken the last step)
                self.finish_reason = finish_reason
                return
            anchor = step.token_ids[-1]
            room = self.max_context_tokens - committed - 1
            if room < 0:
                self.finish_reason = FINISH_LENGTH
                return
            budget = min(self.num_drafts, self.stops.max_new_tokens - num_emitted - 1, room)
            # With no budget this is the request's last step: the drafter's context can stay
            # behind. A paced-out step drafts nothing but still feeds the drafter's context.
            began = self.clock()
            drafts, is_timed = [], False
            if budget > 0 and self.drafter is not None:
                is_paced_out = self.pacing is not None and not self.pacing.should_draft()
                drafts = await self._draft(step.features, anchor, 0 if is_paced_out else budget)
                # A step's cost for the pacing: a drafted or paced-out step of a working
                # drafter, not the first (it also brings the prompt's context to the drafter).
                is_timed = self.drafter is not None and committed > len(self.prompt_ids)
            step = await self.target.verify([anchor, *drafts])
            self.stats.record(len(drafts), self._emitted_drafts(step))
            if self.pacing is not None:
                seconds = self.clock() - began if is_timed else None
                self.pacing.record(len(drafts), step.num_accepted, seconds)
            committed += step.num_accepted + 1

    def _emitted(self, token_ids: list[int], num_emitted: int) -> tuple[list[int], str | None]:
        """A step's tokens up to the first stop (a stop token, which is emitted, or the
        max_new_tokens-th token), and why the request ends there (None: it goes on)."""
        for index, token in enumerate(token_ids):
            if token in self.stops.stop_token_ids:
                return list(token_ids[: index + 1]), FINISH_STOP
            if num_emitted + index + 1 >= self.stops.max_new_tokens:
                return list(token_ids[: index + 1]), FINISH_LENGTH
        return list(token_ids), None

    def _emitted_drafts(self, step) -> int:
        """Accepted drafts that will be emitted: the target checks a whole block, so drafts
        that match its text past a stop token count as accepted there but are never sent
        (the statistics count what the client gets)."""
        stops = self.stops.stop_token_ids
        stop_at = next((i for i, t in enumerate(step.token_ids) if t in stops), None)
        return step.num_accepted if stop_at is None else min(step.num_accepted, stop_at + 1)

    async def _draft(self, features, anchor: int, num_drafts: int) -> list[int]:
        """Drafts from the drafter (none when num_drafts is 0: it only takes the features),
        or none (a target-only step) without a working drafter."""
        if self.drafter is None:
            return []
        try:
            return await self.drafter.draft(features, anchor, num_drafts)
        except Exception as error:  # any drafter failure degrades to target-only
            logger.warning("drafter failed (%s); continuing target-only", error)
            self.drafter_error = error
            self.drafter = None
            return []
