"""The engine thread's torch thread count is a service setting, applied on that thread."""

from __future__ import annotations

import asyncio
import threading

import torch

from dflash_serve.batching import DynamicBatcher
from target_service.engine import TargetEngine
from target_service.model.loader import load_target_model
from target_service.model.state import StateShape
from target_service.session import InProcessTarget


def test_initializer_runs_once_on_the_thread_that_runs_batches():
    seen = []
    batcher = DynamicBatcher(
        lambda requests: [threading.current_thread().name for _ in requests],
        4,
        0,
        "probe",
        lambda: seen.append(threading.current_thread().name),
    )

    async def go():
        return [await batcher.submit(i) for i in range(3)]

    names = asyncio.run(go())
    batcher.close()
    assert len(seen) == 1
    assert names == seen * 3
    assert seen[0] != threading.current_thread().name


def test_target_engine_thread_uses_the_configured_thread_count(causal_lm_dir):
    engine = TargetEngine(load_target_model(causal_lm_dir), StateShape(1, 32))
    main_threads = torch.get_num_threads()
    target = InProcessTarget(engine, engine_threads=1)

    async def engine_threads():
        return await target.batcher.run_exclusive(torch.get_num_threads)

    assert asyncio.run(engine_threads()) == 1
    target.close()
    assert torch.get_num_threads() == main_threads  # this thread keeps its own setting
