"""Drafter sessions over an engine in this process, with draft steps batched across sessions."""

from __future__ import annotations

import asyncio
from functools import partial

from dflash_serve.engine_batcher import DEFAULT_MAX_BATCH_SIZE, engine_batcher
from dflash_serve.service_settings import DEFAULT_MAX_WAIT_US
from drafter_service.engine import DrafterEngine
from drafter_service.speculative_step import DraftRequest, add_context_and_draft


class InProcessDrafter:
    def __init__(
        self,
        engine: DrafterEngine,
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
        max_wait_us: int = DEFAULT_MAX_WAIT_US["drafter"],
        engine_threads: int | None = None,
        inline_batches: bool = False,
        max_gap_us: int | None = None,
    ) -> None:
        """engine_threads: torch threads of the engine thread (None: torch's default).
        inline_batches: batches may run on the event loop (the GPU fast path's short forwards)."""
        self.engine = engine
        self.batcher = engine_batcher(
            partial(add_context_and_draft, engine),
            engine.slots,
            "drafter-engine",
            max_batch_size,
            max_wait_us,
            engine_threads,
            inline_batches,
            max_gap_us,
        )

    async def open(self) -> DrafterSequence:
        """Not through `open_session`, as the target's open is: a drafter session's first
        draft comes only after the target's open and prefill, and waiting for it that long
        would hold back every other session's drafts (README, beside
        `DynamicBatcher.open_session`). Only other sessions' first drafts wait for it
        (`expect_first_request`): those of sessions starting together then share a batch."""
        engine = self.engine
        slot = await self.batcher.run_exclusive_undoable(
            engine.open_sequence, engine.close_sequence
        )
        self.batcher.expect_first_request(slot)
        return DrafterSequence(self, slot)

    def close(self) -> None:
        self.batcher.close()


class DrafterSequence:
    """One request's context (implements dflash_serve.speculative.protocols.DrafterSession)."""

    def __init__(self, owner: InProcessDrafter, slot: int) -> None:
        self.owner = owner
        self.slot = slot
        self.is_closed = False
        self.last_forward_ns = 0
        self.last_batch_size = 0

    async def draft(self, features, anchor_id: int, num_drafts: int) -> list[int]:
        drafts = await self.owner.batcher.submit(
            DraftRequest(self.slot, features, anchor_id, num_drafts)
        )
        self.last_forward_ns, self.last_batch_size = drafts.forward_ns, drafts.batch_size
        return drafts.token_ids

    async def close(self) -> None:
        if not self.is_closed:
            self.is_closed = True
            self.owner.batcher.forget(self.slot)
            # Shielded: a close from a cancelled RPC must still free the slot.
            release = self.owner.batcher.run_exclusive(self.owner.engine.close_sequence, self.slot)
            await asyncio.shield(asyncio.ensure_future(release))
