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
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from dflash_serve.speculative.protocols import DrafterSession

logger = logging.getLogger(__name__)


class PendingDrafterSession:
    """Implements DrafterSession over `opening` (started now, awaited at the first draft).
    `on_open_failure(error)` runs as soon as the open fails, whether or not a draft comes."""

    def __init__(
        self,
        opening: Awaitable[DrafterSession],
        on_open_failure: Callable[[BaseException], object] | None = None,
    ) -> None:
        self._opening = asyncio.ensure_future(opening)
        self._on_open_failure = on_open_failure
        self._opening.add_done_callback(self._opened)

    def _opened(self, opening: asyncio.Future) -> None:
        error = self.open_error  # retrieved here: never "exception was never retrieved"
        if error is not None and self._on_open_failure is not None:
            self._on_open_failure(error)

    @property
    def open_error(self) -> BaseException | None:
        """What the open raised, once it has failed (None while it runs, or if it worked)."""
        if not self._opening.done() or self._opening.cancelled():
            return None
        return self._opening.exception()

    async def session(self) -> DrafterSession:
        """The opened session; raises what the open raised. Shielded: a waiter cancelled
        meanwhile leaves the open running, for the next draft or for `close`."""
        return await asyncio.shield(self._opening)

    async def draft(self, features: Any, anchor_id: int, num_drafts: int) -> list[int]:
        return await (await self.session()).draft(features, anchor_id, num_drafts)

    async def close(self) -> None:
        """Close the session, or stop its open (a session opened meanwhile is closed, also
        when this caller is cancelled while the open winds down)."""
        if not self._opening.done():
            self._opening.cancel()
        try:
            await asyncio.wait([self._opening])  # not `await`: the caller's own cancel shows
        except asyncio.CancelledError:
            self._opening.add_done_callback(_close_in_background)
            raise
        session = _opened_session(self._opening)
        if session is not None:
            await session.close()


def _opened_session(opening: asyncio.Future) -> DrafterSession | None:
    """The session an ended open gave; None when it was cancelled or failed (then nothing
    was opened: a cancelled open undoes what it took)."""
    if opening.cancelled() or opening.exception() is not None:
        return None
    return opening.result()


def _close_in_background(opening: asyncio.Future) -> None:
    session = _opened_session(opening)
    if session is not None:
        asyncio.ensure_future(session.close()).add_done_callback(_log_close_failure)


def _log_close_failure(closing: asyncio.Future) -> None:
    if not closing.cancelled() and closing.exception() is not None:
        logger.warning("closing a drafter session failed: %r", closing.exception())
