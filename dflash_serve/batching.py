"""Dynamic batching: requests from concurrent sessions that are ready together run as one call.

A request waits at most `max_wait_us` for companions (no longer than until every session
that could send one has, and with `max_gap_us` no longer than that after the last request
came), and a batch holds at most `max_batch_size` requests. Engines are
not re-entrant: all engine work runs one call at a time. Long work (a long prefill, open,
close) goes through `run_exclusive` to the batcher's own thread, and the event loop stays
free meanwhile; short prompts that may share a forward are submitted like any request, and
a session opened through `open_session` is waited for like one served a moment ago (until
its first request, or for `recent_s`), so that the prompts of sessions opening together
meet in one batch.
With `inline_batches` (the services' GPU fast path, whose graph-replayed forwards take
milliseconds) a batch runs on the event loop itself when that thread is idle: a trip
to the thread and back cost ~0.2 ms per batch on the H200's host, twice per speculative
step. A batch queued behind work on the thread goes there too, so the two never overlap.
Not on the CPU path: its forwards can take seconds (the loop would not answer health
checks meanwhile) and run with the thread's own torch thread count.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Generic, TypeVar

from dflash_serve import step_trace

logger = logging.getLogger(__name__)

# A session neither sending nor served for this long is not waited for (a busy session
# comes back after a step elsewhere: a few to a few tens of milliseconds).
RECENT_SESSION_S = 0.1

Request = TypeVar("Request")
Result = TypeVar("Result")


@dataclass
class BatchCounters:
    """Observable batching behaviour (tests and metrics read it)."""

    num_batches: int = 0
    num_requests: int = 0
    max_batch_size_seen: int = 0
    num_inline_batches: int = 0  # run on the event loop (the thread was idle)
    total_wait_us: int = 0  # time batches waited for companions, in all


class DynamicBatcher(Generic[Request, Result]):
    """Collects `submit`ted requests and runs `run_batch(requests) -> results` on them."""

    def __init__(
        self,
        run_batch: Callable[[Sequence[Request]], Sequence[Result | BaseException]],
        max_batch_size: int,
        max_wait_us: int,
        thread_name: str,
        thread_initializer: Callable[[], object] | None = None,
        num_possible_requests: Callable[[], int] | None = None,
        session_of: Callable[[Request], Hashable] | None = None,
        recent_s: float = RECENT_SESSION_S,
        inline_batches: bool = False,
        max_gap_us: int | None = None,
    ) -> None:
        """thread_initializer runs once on the batcher's thread before its first batch.
        num_possible_requests: how many requests could be pending at most right now (the open
        sessions); a batch never waits for companions beyond that number, so a lone session
        pays no max_wait_us. session_of: the session a request belongs to; with it, only
        sessions that sent a request or got a result within `recent_s` are waited for (one
        whose client stopped reading must not slow the others' every step). inline_batches:
        run a batch on the event loop when the batcher's thread has no work (see above).
        max_gap_us: stop waiting once no request has come for this long (since the wait began
        or the last one came): requests of sessions in step arrive one after another as each
        is handed on, so a long wait serves them while a pause ends it (the sessions not yet
        here are busy elsewhere), except while sessions are opening (`open_session`: their
        opens run one after another on the thread, and each open's end counts as an arrival);
        None: only max_wait_us bounds the wait."""
        if max_batch_size < 1 or max_wait_us < 0 or (max_gap_us is not None and max_gap_us < 1):
            raise ValueError(
                f"max_batch_size must be >= 1, max_wait_us >= 0 and max_gap_us >= 1 or None; "
                f"got {max_batch_size}, {max_wait_us}, {max_gap_us}"
            )
        self._run_batch = run_batch
        self._num_possible_requests = num_possible_requests
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_us / 1e6
        self.max_gap_s = None if max_gap_us is None else max_gap_us / 1e6
        self._last_arrival = float("-inf")  # event-loop time of the latest submit
        self.counters = BatchCounters()
        self._pending: list[tuple[Request, asyncio.Future]] = []
        self._session_of = session_of
        self._recent_s = recent_s
        self._last_seen: dict[Hashable, float] = {}
        self._opening: set[object] = set()  # sessions being opened (`open_session`)
        self._unheard: set[Hashable] = set()  # `expect_first_request`, nothing sent yet
        self._first_requests: set[asyncio.Future] = set()  # pending: a session's first
        self._wakeup: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._trace_name = thread_name
        self._inline_batches = inline_batches
        self._thread_work = 0  # submitted to the thread and not finished there
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=thread_name, initializer=thread_initializer
        )

    async def submit(self, request: Request) -> Result:
        """Queue one request and wait for its result (exceptions are re-raised here)."""
        loop = asyncio.get_running_loop()
        if self._worker is None or self._worker.done():
            self._wakeup = asyncio.Event()
            self._worker = loop.create_task(self._work())
        future = loop.create_future()
        step_trace.mark(f"{self._trace_name}.queued")
        if self._unheard and self._session_of is not None:
            session = self._session_of(request)
            if session in self._unheard:
                self._unheard.discard(session)
                self._first_requests.add(future)
        self._last_arrival = loop.time()
        self._mark_seen([request])
        self._pending.append((request, future))
        self._wakeup.set()
        return await future

    async def open_session(
        self, open_fn: Callable[[], Hashable], close_fn: Callable[[Hashable], object]
    ) -> Hashable:
        """Run `open_fn` (it opens a session and returns its key) on the batcher's thread.
        From this call on, batches wait for the new session's first request as for a
        session served a moment ago: the prompts of sessions that open together then share
        a batch, instead of the first prompt running alone while the others still open.
        Until `open_fn` returns, the session also counts among the `num_possible_requests`.
        A session whose opener is cancelled meanwhile is closed with `close_fn`."""
        loop = asyncio.get_running_loop()
        opening = object()  # the session's stand-in until open_fn has named it
        self._opening.add(opening)
        if self._session_of is not None:
            self._last_seen[opening] = loop.time()
        try:
            session = await self.run_exclusive_undoable(open_fn, close_fn)
        finally:
            self._opening.discard(opening)
            self._last_seen.pop(opening, None)
            self._last_arrival = loop.time()  # a gapped wait gives its prompt the gap
            if self._wakeup is not None:  # a waiting batch counts again (one fewer if it failed)
                self._wakeup.set()
        if self._session_of is not None:
            self._last_seen[session] = loop.time()
        return session

    def expect_first_request(self, session: Hashable) -> None:
        """`session` is open and will send its first request some time from now (a drafter
        session's first draft comes after the target's prefill, however long that takes, so
        it is not opened through `open_session`). A batch of first requests only waits for
        it too, at most max_wait_us: sessions that start together send their first requests
        within a fraction of a millisecond of one another, and the first of them used to run
        alone, the others queueing behind its forward. A batch holding any other request
        does not wait for it."""
        self._unheard.add(session)

    async def run_exclusive_for(self, session: Hashable, fn: Callable, *args):
        """`fn(*args)` on the batcher's thread as `session`'s next work, outside the batch
        queue (a long prompt): batches stop waiting for the session, and the requests
        pending now run first, as they would had the session's work been one of them, instead
        of queueing behind it on the thread."""
        self.forget(session)
        pending = [future for _, future in self._pending]
        if pending:
            await asyncio.wait(pending)
        return await self._on_thread(fn, *args)

    def forget(self, session: Hashable) -> None:
        """Stop waiting for a session until it sends again: it closed (and its slot's next
        owner starts afresh), or its next work does not come through the batch queue."""
        was_expected = session in self._unheard
        self._unheard.discard(session)
        seen = self._last_seen.pop(session, None) is not None
        if (seen or was_expected) and self._wakeup is not None:
            self._wakeup.set()

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                await self._wakeup.wait()
                self._wakeup.clear()
                while self._pending:
                    began = loop.time()
                    await self._gather_companions()
                    self.counters.total_wait_us += round((loop.time() - began) * 1e6)
                    batch = self._pending[: self.max_batch_size]
                    del self._pending[: len(batch)]
                    await self._run(batch)
        except BaseException as error:  # closed, or a bug: no waiter may hang
            for _, future in self._pending:
                if future.done():
                    continue
                if isinstance(error, asyncio.CancelledError):
                    future.cancel()
                else:
                    future.set_exception(error)
            self._pending.clear()
            self._first_requests.clear()
            raise

    async def _gather_companions(self) -> None:
        """Wait up to max_wait_us until as many requests are pending as could be; return as
        soon as they are. Also before a batch of requests that arrived while the previous
        one ran: without that wait, sessions split into groups that alternate between this
        engine and the other service's and never share a batch again."""
        if self.max_wait_s <= 0:
            return
        loop = asyncio.get_running_loop()
        began = loop.time()
        deadline = began + self.max_wait_s
        while self._num_live_pending() < self._largest_possible_batch():
            end = deadline
            if self.max_gap_s is not None and not self._opening:
                end = min(end, max(self._last_arrival, began) + self.max_gap_s)
            remaining = end - loop.time()
            if remaining <= 0:
                return
            if self._last_seen:  # look again when the oldest session would go stale
                oldest = min(self._last_seen.values())
                remaining = min(remaining, max(oldest + self._recent_s - loop.time(), 0) + 1e-4)
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), remaining)
            except TimeoutError:
                continue  # the deadline, or a session going stale: check again

    def _num_live_pending(self) -> int:
        return sum(not future.cancelled() for _, future in self._pending)

    def _mark_seen(self, requests: Sequence[Request]) -> None:
        if self._session_of is not None:
            now = asyncio.get_running_loop().time()
            for request in requests:
                self._last_seen[self._session_of(request)] = now

    def _largest_possible_batch(self) -> int:
        largest = self.max_batch_size
        if self._num_possible_requests is not None:  # the open sessions, and those opening
            largest = min(largest, self._num_possible_requests() + len(self._opening))
        if self._session_of is not None:
            since = asyncio.get_running_loop().time() - self._recent_s
            stale = [key for key, at in self._last_seen.items() if at < since]
            for key in stale:
                del self._last_seen[key]
            # A request pending for longer than recent_s still counts its own session.
            pending = {self._session_of(request) for request, _ in self._pending}
            expected = pending | self._last_seen.keys()
            if self._unheard and self._only_first_requests_pending():
                expected |= self._unheard
            largest = min(largest, len(expected))
        return largest

    def _only_first_requests_pending(self) -> bool:
        return all(future in self._first_requests for _, future in self._pending)

    async def _run(self, batch: list[tuple[Request, asyncio.Future]]) -> None:
        self._first_requests.difference_update(future for _, future in batch)
        live = [(request, future) for request, future in batch if not future.cancelled()]
        if not live:
            return
        self.counters.num_batches += 1
        self.counters.num_requests += len(live)
        self.counters.max_batch_size_seen = max(self.counters.max_batch_size_seen, len(live))
        requests = [request for request, _ in live]
        run_batch = self._traced_run_batch if step_trace.is_enabled() else self._run_batch
        step_trace.mark(f"{self._trace_name}.batch")
        try:
            is_inline = self._inline_batches and self._thread_work == 0
            if is_inline:
                await asyncio.sleep(0)  # the previous batch's waiters send their results first
                is_inline = self._thread_work == 0  # and may have given the thread work
            if is_inline:
                self.counters.num_inline_batches += 1
                results = run_batch(requests)
            else:
                results = await self._on_thread(run_batch, requests)
            step_trace.mark(f"{self._trace_name}.resumed")
            if len(results) != len(live):
                raise RuntimeError(f"a batch of {len(live)} requests got {len(results)} results")
        except Exception as error:  # handed to every waiter of this batch
            logger.exception("batch of %d failed", len(live))
            results = [error] * len(live)
        except BaseException:  # cancelled (the batcher closed) while the batch ran
            for _, future in live:  # its requests left the queue: no waiter of it may hang
                future.cancel()
            raise
        for (_, future), result in zip(live, results, strict=True):
            if future.done():
                continue
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)
        step_trace.mark(f"{self._trace_name}.resolved")
        self._mark_seen(requests)  # their sessions come back after a step elsewhere

    def _traced_run_batch(self, requests):
        step_trace.mark(f"{self._trace_name}.thread_start")
        results = self._run_batch(requests)
        step_trace.mark(f"{self._trace_name}.thread_end")
        return results

    async def run_exclusive(self, fn: Callable, *args):
        """Run non-batched engine work on the batcher's thread, between batches."""
        return await self._on_thread(fn, *args)

    async def run_exclusive_undoable(self, fn: Callable[[], object], undo_fn: Callable):
        """`run_exclusive(fn)` for work that takes something (a session's slot): if the waiter
        is cancelled before it has the result (its client went away), `undo_fn(result)` runs
        on the thread next, so that nothing taken stays taken with no one to give it back."""
        work = self._on_thread(fn)
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            work.add_done_callback(partial(self._undo_finished, undo_fn))
            raise

    def _undo_finished(self, undo_fn: Callable, work: asyncio.Future) -> None:
        if work.cancelled():
            return  # never ran (the batcher closed): nothing was taken
        if work.exception() is not None:  # nothing was taken; no caller is left to tell
            logger.info("work whose caller left failed: %r", work.exception())
            return
        with contextlib.suppress(RuntimeError):  # the batcher closed: nothing is left to free
            undone = self._on_thread(undo_fn, work.result())
            undone.add_done_callback(_log_failure)

    def _on_thread(self, fn: Callable, *args) -> asyncio.Future:
        """`fn(*args)` on the batcher's thread. The work counts until it has finished there,
        even if its waiter is cancelled first, so no inline batch can overlap it."""
        loop = asyncio.get_running_loop()
        work = self._executor.submit(fn, *args)  # (RuntimeError once closed: nothing counted)
        self._thread_work += 1

        def finished() -> None:
            self._thread_work -= 1

        def on_done(_work) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed first: nothing to count
                loop.call_soon_threadsafe(finished)

        work.add_done_callback(on_done)
        return asyncio.wrap_future(work, loop=loop)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
        self._executor.shutdown(wait=True, cancel_futures=True)


def _log_failure(work: asyncio.Future) -> None:
    """Done-callback of work no one awaits: its failure is logged, not lost."""
    if not work.cancelled() and work.exception() is not None:
        logger.error("work after a cancelled caller failed", exc_info=work.exception())
