"""A scripted drafter for tests and benchmarks — never a serving default.

It proposes the known target continuation with a chosen acceptance pattern: for step s it
plans to have `accept_pattern[s % len]` drafts accepted, proposing that many correct tokens
followed by deliberately wrong ones. This imposes an acceptance length τ exactly, so that
speed at a given τ can be measured and every acceptance count can be exercised.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class ScriptedDrafter:
    """Implements DrafterSession; `continuation` is the target-only output of the request."""

    def __init__(
        self, continuation: Sequence[int], accept_pattern: Sequence[int], vocab_size: int
    ) -> None:
        if not accept_pattern or min(accept_pattern) < 0:
            raise ValueError(f"accept_pattern must be non-empty and >= 0: {accept_pattern}")
        self.continuation = list(continuation)
        self.accept_pattern = list(accept_pattern)
        self.vocab_size = vocab_size
        self.num_steps = 0
        # The prefill emitted continuation[0]; the next anchor is the last emitted token.
        self.num_emitted = 1

    def _known(self, index: int) -> int:
        """The continuation token at `index`, or an arbitrary id past its end."""
        return self.continuation[index] if index < len(self.continuation) else 0

    async def draft(self, features: Any, anchor_id: int, num_drafts: int) -> list[int]:
        planned = self.accept_pattern[self.num_steps % len(self.accept_pattern)]
        accepted = min(planned, num_drafts)
        drafts = [self._known(self.num_emitted + i) for i in range(num_drafts)]
        for i in range(accepted, num_drafts):
            drafts[i] = (self._known(self.num_emitted + i) + 1) % self.vocab_size
        self.num_steps += 1
        self.num_emitted += accepted + 1
        return drafts

    async def close(self) -> None:
        return None
