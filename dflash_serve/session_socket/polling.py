"""Keeping an event loop polling its sockets while session readers wait for a reply.

A process asleep in epoll wakes slowly after the milliseconds a step leaves it idle; one
whose loop polls (selects with no timeout) does not: on the H200 host that halved each
message's wake-up. One callback per loop keeps it polling for all the readers waiting in
it, so an iteration of the loop costs one callback whatever the number of sessions. (Until
2026-12-06 each reader polled in its own task: with 8 sessions waiting, every message was
handled behind 8 task steps of polling on each of the iterations it took.)
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import Iterator


class LoopPoller:
    """Polls one event loop while any reader is waiting within its spin."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._num_waiting = 0
        self._poll_until = 0.0  # the loop's clock
        self._is_ticking = False

    @contextlib.contextmanager
    def polling(self, spin_s: float) -> Iterator[None]:
        """While inside: the loop polls for at most `spin_s` from now (or as long as another
        reader inside wants), then sleeps in its selector as usual."""
        self._num_waiting += 1
        self._poll_until = max(self._poll_until, self._loop.time() + spin_s)
        if not self._is_ticking:
            self._is_ticking = True
            self._loop.call_soon(self._tick)
        try:
            yield
        finally:
            self._num_waiting -= 1

    def _tick(self) -> None:
        # A callback ready for the next iteration makes the loop select without a timeout.
        if self._num_waiting and self._loop.time() < self._poll_until:
            self._loop.call_soon(self._tick)
        else:
            self._is_ticking = False


_POLLERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def kept_polling(spin_s: float) -> contextlib.AbstractContextManager:
    """The running loop's poller, polling for a reader that waits up to `spin_s` so."""
    loop = asyncio.get_running_loop()
    poller = _POLLERS.get(loop)
    if poller is None:
        poller = _POLLERS[loop] = LoopPoller(loop)
    return poller.polling(spin_s)
