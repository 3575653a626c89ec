"""Target sessions over an engine in this process, with verify steps batched across sessions.

All engine work runs on one thread (the engine is not re-entrant); the gRPC servicer wraps
these same sessions, and tests and benchmarks use them directly. Short prompts go through the
batcher too, so that sessions starting together share prefill forwards.
"""

from __future__ import annotations

import asyncio
import time
from functools import partial

from dflash_serve.engine_batcher import DEFAULT_MAX_BATCH_SIZE, engine_batcher
from dflash_serve.service_settings import DEFAULT_MAX_WAIT_US
from dflash_serve.speculative.types import SamplingParams, TargetStep
from target_service.engine import TargetEngine
from target_service.speculative_step import (
    PrefillRequest,
    VerifyRequest,
    prefill_and_choose,
    prefill_result,
    run_target_batch,
)


class InProcessTarget:
    """Opens sessions on a TargetEngine; owns the engine thread and the verify batcher."""

    def __init__(
        self,
        engine: TargetEngine,
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
        max_wait_us: int = DEFAULT_MAX_WAIT_US["target"],
        engine_threads: int | None = None,
        inline_batches: bool = False,
        max_gap_us: int | None = None,
    ) -> None:
        """engine_threads: torch threads of the engine thread (None: torch's default).
        inline_batches: batches may run on the event loop (the GPU fast path's short forwards)."""
        self.engine = engine
        self.batcher = engine_batcher(
            partial(run_target_batch, engine),
            engine.slots,
            "target-engine",
            max_batch_size,
            max_wait_us,
            engine_threads,
            inline_batches,
            max_gap_us,
        )

    async def open(self, sampling: SamplingParams) -> TargetSequence:
        sampling.validate()
        slot = await self.batcher.open_session(
            self.engine.open_sequence, self.engine.close_sequence
        )
        return TargetSequence(self, slot, sampling)

    def close(self) -> None:
        self.batcher.close()


class TargetSequence:
    """One request's sequence (implements dflash_serve.speculative.protocols.TargetSession)."""

    def __init__(self, owner: InProcessTarget, slot: int, sampling: SamplingParams) -> None:
        self.owner = owner
        self.slot = slot
        self.sampling = sampling
        self.is_closed = False

    async def prefill(self, prompt_ids: list[int]) -> TargetStep:
        """A long prompt in one engine call; a short one through the batcher, so that the
        prompts of sessions starting together share forwards: as one row of a padded prefill
        (`TargetEngine.shares_prefills`) or as verify blocks."""
        engine, prompt_ids = self.owner.engine, list(prompt_ids)
        if not engine.prefills_in_blocks(len(prompt_ids)):
            if engine.shares_prefills(self.slot, len(prompt_ids)):
                request = PrefillRequest(self.slot, prompt_ids, self.sampling)
                try:
                    return await self.owner.batcher.submit(request)
                except Exception:  # whatever failed, the session can prefill again
                    await self.owner.batcher.run_exclusive(engine.reset_sequence, self.slot)
                    raise
            return await self.owner.batcher.run_exclusive_for(
                self.slot, prefill_and_choose, engine, self.slot, prompt_ids, self.sampling
            )
        began_ns = time.perf_counter_ns()
        batcher = self.owner.batcher
        await batcher.run_exclusive(engine.check_prompt, self.slot, prompt_ids)  # before a block
        steps = []
        try:
            for block in engine.prompt_blocks(prompt_ids):
                request = VerifyRequest(self.slot, block, self.sampling, keep_all=True)
                steps.append(await batcher.submit(request))
        except Exception:  # nothing stays committed: the session can prefill again
            await batcher.run_exclusive(engine.reset_sequence, self.slot)
            raise
        return prefill_result(steps, began_ns)

    async def verify(self, block_ids: list[int]) -> TargetStep:
        return await self.owner.batcher.submit(
            VerifyRequest(self.slot, list(block_ids), self.sampling)
        )

    async def close(self) -> None:
        if not self.is_closed:
            self.is_closed = True
            self.owner.batcher.forget(self.slot)
            # Shielded: a close from a cancelled RPC must still free the slot.
            release = self.owner.batcher.run_exclusive(self.owner.engine.close_sequence, self.slot)
            await asyncio.shield(asyncio.ensure_future(release))
