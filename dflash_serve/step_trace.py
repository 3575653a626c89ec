"""Timestamps along a speculative step in all three processes, for `bench.trace_step`.

Off (one dictionary lookup at import, then a test of a module global per call) unless the
environment variable DFLASH_STEP_TRACE names a file prefix: then every process appends lines
`event monotonic_ns` to `<prefix>.<pid>`. CLOCK_MONOTONIC is one clock for all processes of a
machine, so the files merge into one timeline of where a step's time goes between the
gateway, the gRPC transport, the servicers, the batchers and the engines. A traced process
also marks the start and end of its older-generation garbage collections (`gc.start.gen2`,
...), which stop every thread of it for as long as they walk the heap.
"""

from __future__ import annotations

import gc
import os
import time
from typing import TextIO

TRACE_ENV = "DFLASH_STEP_TRACE"

_prefix = os.environ.get(TRACE_ENV) or None
_file: TextIO | None = None


def enable(prefix: str) -> None:
    """Trace this process, and the processes it starts from now on, to `prefix`.<pid>."""
    global _prefix
    _prefix = prefix
    os.environ[TRACE_ENV] = prefix
    _watch_collections()


def is_enabled() -> bool:
    return _prefix is not None


def mark(event: str) -> None:
    """Record that `event` happens now (nothing when tracing is off)."""
    global _file
    if _prefix is None:
        return
    if _file is None:
        _file = open(f"{_prefix}.{os.getpid()}", "a", buffering=1)  # noqa: SIM115 (process-long)
    _file.write(f"{event} {time.perf_counter_ns()}\n")


def _mark_collection(phase: str, info: dict) -> None:
    """gc callback: generation 0 runs every few hundred allocations and takes microseconds,
    so only the older generations' collections are marked."""
    if info["generation"] >= 1:
        mark(f"gc.{phase}.gen{info['generation']}")


def _watch_collections() -> None:
    if _mark_collection not in gc.callbacks:
        gc.callbacks.append(_mark_collection)


if _prefix is not None:
    _watch_collections()
