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

import pytest

from dflash_serve import stall_watch

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/proc/self/task"), reason="per-thread times come from Linux's /proc"
)


def records(out: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_a_collection_holding_the_gil_is_reported_as_a_stall_of_the_main_thread():
    garbage = [[] for _ in range(2_000_000)]  # walked by a full collection: ~0.1 s
    out = io.StringIO()
    watch = stall_watch.StallWatch(out, stall_s=0.03, gc_ms=20)
    watch.start()
    try:
        time.sleep(0.1)  # the watcher runs and snapshots; sleeping holds nothing
        began, cpu_began = time.perf_counter(), time.thread_time()
        gc.collect()
        held_ms = (time.perf_counter() - began) * 1e3
        cpu_ms = (time.thread_time() - cpu_began) * 1e3  # on a loaded machine: < held_ms
        time.sleep(0.1)  # time to notice and write
    finally:
        watch.stop()
    del garbage
    lines = records(out)
    (collection,) = [r for r in lines if r["event"] == "gc" and r["generation"] == 2]
    assert 20 <= collection["ms"] <= held_ms + 1
    stalls = [r for r in lines if r["event"] == "stall"]
    assert stalls, f"a {held_ms:.0f} ms collection went unnoticed"
    longest = max(stalls, key=lambda r: r["ms"])
    assert longest["ms"] >= 0.5 * held_ms
    busiest = longest["threads"][0]
    assert busiest["name"] == "MainThread"  # the collecting thread burned the time
    assert busiest["user_ms"] + busiest["system_ms"] >= 0.5 * cpu_ms - 20  # 10 ms ticks
    # Where the main thread is once the watcher runs again: just past the collection.
    assert any("test_stall_watch.py" in line for line in longest["main_stack"])
    assert watch._on_collection not in gc.callbacks  # stop() unhooks the collector


def test_a_collection_only_queues_its_record_for_the_watcher_to_write():
    """A collection can start inside the watcher's own write: writing from the callback
    would re-enter the file (or wait forever on a lock held by its own thread)."""
    out = io.StringIO()
    watch = stall_watch.StallWatch(out, gc_ms=0)
    watch._on_collection("start", {"generation": 1, "collected": 0, "uncollectable": 0})
    watch._on_collection("stop", {"generation": 1, "collected": 3, "uncollectable": 0})
    assert out.getvalue() == ""
    watch._thread.start()  # the watcher alone, without the gc hook: it writes the record
    watch.stop()
    (record,) = records(out)
    assert record["event"] == "gc" and record["generation"] == 1 and record["collected"] == 3


def test_thread_times_are_the_kernels_user_and_system_time_of_each_thread():
    """The fields read are the thread's user and system time, in that order: the same
    figures getrusage(RUSAGE_THREAD) gives, in clock ticks."""
    resource = pytest.importorskip("resource")
    me = threading.get_native_id()
    buffer = bytearray(1 << 20)
    deadline = time.monotonic() + 5
    with open("/dev/zero", "rb", buffering=0) as zero:
        while True:  # copying from /dev/zero is kernel work: until the two differ clearly
            before = resource.getrusage(resource.RUSAGE_THREAD)
            if abs(before.ru_stime - before.ru_utime) > 0.1 or time.monotonic() > deadline:
                break
            zero.readinto(buffer)
    _, user, system = stall_watch.thread_times()[me]
    after = resource.getrusage(resource.RUSAGE_THREAD)
    tick_s = stall_watch._CLOCK_TICK_MS / 1e3
    assert before.ru_utime - tick_s <= user * tick_s <= after.ru_utime + tick_s
    assert before.ru_stime - tick_s <= system * tick_s <= after.ru_stime + tick_s
    assert abs(after.ru_stime - after.ru_utime) > 0.1  # so a swap of the two would show


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
