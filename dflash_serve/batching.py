"""Dynamic batching: requests from concurrent sessions that are ready together run as one call.

A request waits at most `max_wait_us` for companions, and a batch holds at most
`max_batch_size` requests. Batches run on the batcher's own thread, which owns the engine
(engines are not re-entrant): other engine work (prefill, open, close) goes through
`run_exclusive` on the same thread. The event loop stays free meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

Request = TypeVar("Request")
Result = TypeVar("Result")


@dataclass
class BatchCounters:
    """Observable batching behaviour (tests and metrics read it)."""

    num_batches: int = 0
    num_requests: int = 0
    max_batch_size_seen: int = 0


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
    ) -> None:
        """thread_initializer runs once on the batcher's thread before its first batch.
        num_possible_requests: how many requests could be pending at most right now (the open
        sessions); a batch never waits for companions beyond that number, so a lone session
        pays no max_wait_us."""
        if max_batch_size < 1 or max_wait_us < 0:
            raise ValueError(
                f"max_batch_size must be >= 1 and max_wait_us >= 0; got "
                f"{max_batch_size}, {max_wait_us}"
            )
        self._run_batch = run_batch
        self._num_possible_requests = num_possible_requests
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_us / 1e6
        self.counters = BatchCounters()
        self._pending: list[tuple[Request, asyncio.Future]] = []
        self._wakeup: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
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
        self._pending.append((request, future))
        self._wakeup.set()
        return await future

    async def _work(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            if self.max_wait_s > 0 and len(self._pending) < self._largest_possible_batch():
                await asyncio.sleep(self.max_wait_s)
            while self._pending:
                batch = self._pending[: self.max_batch_size]
                del self._pending[: len(batch)]
                await self._run(batch)

    def _largest_possible_batch(self) -> int:
        if self._num_possible_requests is None:
            return self.max_batch_size
        return min(self.max_batch_size, self._num_possible_requests())

    async def _run(self, batch: list[tuple[Request, asyncio.Future]]) -> None:
        live = [(request, future) for request, future in batch if not future.cancelled()]
        if not live:
            return
        self.counters.num_batches += 1
        self.counters.num_requests += len(live)
        self.counters.max_batch_size_seen = max(self.counters.max_batch_size_seen, len(live))
        requests = [request for request, _ in live]
        loop = asyncio.get_running_loop()
        try:
            results = await loop.run_in_executor(self._executor, self._run_batch, requests)
        except Exception as error:  # handed to every waiter of this batch
            logger.exception("batch of %d failed", len(live))
            results = [error] * len(live)
        for (_, future), result in zip(live, results, strict=True):
            if future.done():
                continue
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)

    async def run_exclusive(self, fn: Callable, *args):
        """Run non-batched engine work on the engine thread, between batches."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
        self._executor.shutdown(wait=True, cancel_futures=True)
