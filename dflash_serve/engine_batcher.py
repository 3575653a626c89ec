"""The batcher that owns a model engine: used by the target and the drafter alike.

Its one thread runs every engine call, with the torch thread count the service asked for
(see ServiceSettings.engine_threads), and a batch waits for companions only while more
sessions are open (and recently active) than are already pending.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch

from dflash_serve.batching import DynamicBatcher
from dflash_serve.slots import SlotAllocator

DEFAULT_MAX_BATCH_SIZE = 16


def engine_batcher(
    run_batch: Callable[[Sequence], Sequence],
    slots: SlotAllocator,
    thread_name: str,
    max_batch_size: int,
    max_wait_us: int,
    engine_threads: int | None = None,
    inline_batches: bool = False,
    max_gap_us: int | None = None,
) -> DynamicBatcher:
    """engine_threads: torch intra-op threads of the engine thread (None: torch's default).
    inline_batches: batches may run on the event loop (short GPU forwards; see batching.py).
    max_gap_us: see DynamicBatcher. Requests carry the `slot` of their session."""
    setup = None if engine_threads is None else partial(torch.set_num_threads, engine_threads)
    return DynamicBatcher(
        run_batch,
        max_batch_size,
        max_wait_us,
        thread_name,
        setup,
        lambda: slots.num_active,
        session_of=lambda request: request.slot,
        inline_batches=inline_batches,
        max_gap_us=max_gap_us,
    )
