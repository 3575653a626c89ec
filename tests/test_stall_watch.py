"""The stall watcher: a process held up (here by a long garbage collection, which keeps the
GIL) is reported with how long, which threads burned CPU meanwhile, and where the main thread
was; off unless DFLASH_STALL_WATCH names a directory."""

from __future__ import annotations

import gc
import io
import json
import os
import threading
import time

from dflash_serve import stall_watch


def records(out: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_a_collection_holding_the_gil_is_reported_as_a_stall_of_the_main_thread():
    garbage = [[] for _ in range(2_000_000)]  # walked by a full collection: ~0.1 s
    out = io.StringIO()
    watch = stall_watch.StallWatch(out, stall_s=0.03, gc_ms=20)
    watch.start()
    try:
        time.sleep(0.1)  # the watcher runs and snapshots; sleeping holds nothing
        began = time.perf_counter()
        gc.collect()
        held_ms = (time.perf_counter() - began) * 1e3
        time.sleep(0.1)  # time to notice and write
    finally:
        watch.stop()
    del garbage
    lines = records(out)
    (collection,) = [r for r in lines if r["event"] == "gc" and r["generation"] == 2]
    assert collection["ms"] >= 20 and collection["ms"] <= held_ms + 1
    stalls = [r for r in lines if r["event"] == "stall"]
    assert stalls, f"a {held_ms:.0f} ms collection went unnoticed"
    longest = max(stalls, key=lambda r: r["ms"])
    assert longest["ms"] >= 0.5 * held_ms
    busiest = longest["threads"][0]
    assert busiest["name"] == "MainThread"  # the collecting thread burned the time
    assert busiest["user_ms"] + busiest["system_ms"] >= 0.3 * held_ms
    # Where the main thread is once the watcher runs again: just past the collection.
    assert any("test_stall_watch.py" in line for line in longest["main_stack"])
    assert longest["span_ms"] >= longest["ms"]
    assert watch._on_collection not in gc.callbacks  # stop() unhooks the collector


def test_thread_times_count_a_busy_threads_cpu_under_its_id():
    before = stall_watch.thread_times()
    me = threading.get_native_id()
    assert me in before
    end = time.process_time() + 0.1
    while time.process_time() < end:
        pass
    _, user, system = stall_watch.thread_times()[me]
    assert (user + system) - (before[me][1] + before[me][2]) >= 5  # 10 ms ticks: ~10


def test_off_by_default_and_one_log_per_process_when_on(tmp_path, monkeypatch):
    monkeypatch.setattr(stall_watch, "_started", None)
    monkeypatch.delenv(stall_watch.STALL_WATCH_ENV, raising=False)
    assert stall_watch.start_if_enabled() is None
    monkeypatch.setenv(stall_watch.STALL_WATCH_ENV, str(tmp_path / "watch"))
    watch = stall_watch.start_if_enabled()
    try:
        assert watch is not None and stall_watch.start_if_enabled() is watch  # once
        assert (tmp_path / "watch" / f"{os.getpid()}.log").exists()
    finally:
        watch.stop()
        watch.out.close()
