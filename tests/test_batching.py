"""The dynamic batcher: its thread (and the torch thread count set on it), and when it waits."""

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


def sleeps_before_a_lone_request(monkeypatch, num_possible) -> list[float]:
    """The batcher's waits (asyncio.sleep calls) around one request."""
    import dflash_serve.batching as batching

    waits = []
    real_sleep = asyncio.sleep

    async def recording_sleep(seconds):
        waits.append(seconds)
        await real_sleep(0)

    monkeypatch.setattr(batching.asyncio, "sleep", recording_sleep)
    batcher = DynamicBatcher(lambda requests: list(requests), 8, 500, "wait", None, num_possible)

    async def go():
        return await batcher.submit("only")

    assert asyncio.run(go()) == "only"
    batcher.close()
    return waits


def test_a_lone_session_does_not_wait_for_companions(monkeypatch):
    assert sleeps_before_a_lone_request(monkeypatch, lambda: 1) == []


def test_a_request_waits_when_other_sessions_are_open(monkeypatch):
    assert sleeps_before_a_lone_request(monkeypatch, lambda: 3) == [500e-6]


def test_without_a_session_count_the_batcher_always_waits(monkeypatch):
    assert sleeps_before_a_lone_request(monkeypatch, None) == [500e-6]
