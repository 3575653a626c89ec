"""A drafter session still opening (PendingDrafterSession): drafts wait for the open, a
failed open is reported once, and nothing opened is left open, whoever is cancelled."""

from __future__ import annotations

import asyncio

import pytest

from dflash_serve.speculative.pending_drafter import PendingDrafterSession


class Session:
    def __init__(self, events: list[str]) -> None:
        self.events = events

    async def draft(self, features, anchor_id, num_drafts):
        return [anchor_id + 1] * num_drafts

    async def close(self) -> None:
        self.events.append("closed")


async def open_after(delay_s: float, events: list[str], error: Exception | None = None):
    await asyncio.sleep(delay_s)
    if error is not None:
        raise error
    events.append("opened")
    return Session(events)


def test_a_draft_waits_for_the_open_and_close_closes_the_session():
    events: list[str] = []

    async def go():
        pending = PendingDrafterSession(open_after(0.05, events))
        assert await pending.draft(None, 7, 3) == [8, 8, 8]
        await pending.close()

    asyncio.run(asyncio.wait_for(go(), 2))
    assert events == ["opened", "closed"]


def test_a_failed_open_fails_the_draft_and_is_reported_once_without_a_draft_too():
    failures: list[BaseException] = []
    error = ConnectionError("drafter down")

    async def go():
        drafted = PendingDrafterSession(open_after(0.01, [], error), failures.append)
        with pytest.raises(ConnectionError):
            await drafted.draft(None, 7, 3)
        assert drafted.open_error is error
        await drafted.close()
        never_drafted = PendingDrafterSession(open_after(0.01, [], error), failures.append)
        await asyncio.sleep(0.05)
        await never_drafted.close()

    asyncio.run(asyncio.wait_for(go(), 2))
    assert failures == [error, error]


def test_a_cancelled_draft_leaves_the_open_running_for_the_next():
    events: list[str] = []

    async def go():
        pending = PendingDrafterSession(open_after(0.05, events))
        waiting = asyncio.ensure_future(pending.draft(None, 1, 1))
        await asyncio.sleep(0.01)
        waiting.cancel()
        assert await pending.draft(None, 1, 2) == [2, 2]
        await pending.close()

    asyncio.run(asyncio.wait_for(go(), 2))
    assert events == ["opened", "closed"]


def test_close_stops_an_open_still_running():
    events: list[str] = []

    async def go():
        pending = PendingDrafterSession(open_after(10, events))
        await asyncio.sleep(0.01)
        await pending.close()
        assert pending.open_error is None

    asyncio.run(asyncio.wait_for(go(), 2))
    assert events == []


def test_a_session_opened_while_close_was_cancelled_is_still_closed():
    """The open ignores cancellation a moment (as a gRPC call finishing its open does);
    the caller of close is cancelled meanwhile: the session opened is closed anyway."""
    events: list[str] = []

    async def stubborn_open():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            await asyncio.sleep(0.05)  # the open finishes regardless
        events.append("opened")
        return Session(events)

    async def go():
        pending = PendingDrafterSession(stubborn_open())
        await asyncio.sleep(0.01)
        closing = asyncio.ensure_future(pending.close())
        await asyncio.sleep(0.01)
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
        await asyncio.sleep(0.1)

    asyncio.run(asyncio.wait_for(go(), 2))
    assert events == ["opened", "closed"]
