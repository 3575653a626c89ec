"""What the loop needs from a target session and a drafter session.

Implemented in-process by `target_service.session` / `drafter_service.session` and over gRPC
by the gateway's clients; the loop cannot tell the difference.
"""

from __future__ import annotations

from typing import Any, Protocol

from dflash_serve.speculative.types import TargetStep


class TargetSession(Protocol):
    """One request's sequence on the target; sampling parameters were fixed at open."""

    async def prefill(self, prompt_ids: list[int]) -> TargetStep:
        """Commit the prompt; token_ids = [the target's first token]; features of the prompt."""
        ...

    async def verify(self, block_ids: list[int]) -> TargetStep:
        """Verify [anchor, d1..dk]; commit the anchor and the accepted drafts."""
        ...

    async def close(self) -> None: ...


class DrafterSession(Protocol):
    """One request's context on the drafter."""

    async def draft(self, features: Any, anchor_id: int, num_drafts: int) -> list[int]:
        """Append `features` (committed tokens) to the context, then propose num_drafts
        drafts (none when num_drafts is 0)."""
        ...

    async def close(self) -> None: ...
