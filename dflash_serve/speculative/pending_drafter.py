"""A drafter session whose open is still under way, so that a request's prompt need not wait.

The target's batcher expects a new session's prompt from the moment it opens (sessions
opening together share one prefill forward; see `DynamicBatcher.open_session`). Opening the
drafter's session first and the target's after kept the prompt right behind the target's
open, but spread the target's opens of a burst of requests over the drafter's opens: the
first prompts then ran without the later ones (8 streams on an H100: prefills of 5 and 3,
and the two groups never shared a step again). Opened alongside the target's session, the
drafter's open overlaps the prefill; only the first draft waits for it, and a failed open
fails that draft, which the loop answers by going on target-only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from dflash_serve.speculative.protocols import DrafterSession


class PendingDrafterSession:
    """Implements DrafterSession over `opening` (started now, awaited at the first draft)."""

    def __init__(self, opening: Awaitable[DrafterSession]) -> None:
        self._opening = asyncio.ensure_future(opening)

    async def session(self) -> DrafterSession:
        """The opened session; raises what the open raised."""
        return await self._opening

    async def draft(self, features: Any, anchor_id: int, num_drafts: int) -> list[int]:
        return await (await self.session()).draft(features, anchor_id, num_drafts)

    async def close(self) -> None:
        """Close the session, or stop its open (a session opened meanwhile is closed)."""
        if not self._opening.done():
            self._opening.cancel()
        await asyncio.wait([self._opening])  # not `await`: the caller's own cancel must show
        if self._opening.cancelled() or self._opening.exception() is not None:
            return  # nothing was opened (the open undoes what it took when cancelled)
        await self._opening.result().close()
