"""When to draft: back off while drafts keep being rejected, resume as soon as one lands.

A drafted step costs a drafter forward and a 16-token verify; when the drafter cannot
predict the target (a prompt unlike its training, say) that cost buys nothing, and
speculative decoding becomes slower than the target alone. After two drafted steps in a
row with nothing accepted, the loop skips drafting for 1, 2, 4, then at most
`max_skipped_steps` steps between probes; any accepted draft restores drafting every step.
Skipped steps still hand the drafter the committed tokens' features, so its context stays
complete, and the output is the target's either way.
"""

from __future__ import annotations

from dataclasses import dataclass

MISSES_BEFORE_BACKOFF = 2


@dataclass
class DraftPacing:
    max_skipped_steps: int = 8
    num_misses: int = 0  # drafted steps in a row with no draft accepted
    num_to_skip: int = 0  # steps left before the next probe

    def should_draft(self) -> bool:
        if self.num_to_skip > 0:
            self.num_to_skip -= 1
            return False
        return True

    def record(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted == 0:
            return
        if num_accepted > 0:
            self.num_misses = 0
            return
        self.num_misses += 1
        if self.num_misses >= MISSES_BEFORE_BACKOFF:
            backoff = 2 ** (self.num_misses - MISSES_BEFORE_BACKOFF)
            self.num_to_skip = min(backoff, self.max_skipped_steps)
