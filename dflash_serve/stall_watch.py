"""Where a process stops: a watcher thread that notices when it could not run for a while and
writes what every thread of the process did meanwhile (Linux: it reads /proc/self/task).

Why: the suite's slow concurrency rounds (1.6-3.3x under their median) had every engine
forward at its usual time; the time was lost in one process, and this says which and in what
(`bench/results/client-stalls-2026-12-07-nvidia-h100.json`).

Off unless DFLASH_STALL_WATCH names a directory; then `start_if_enabled` (the launcher's
processes, `bench.suite` and its e2e client; children inherit the variable) writes JSON
lines to `<dir>/<pid>.log`:
- `stall`: the watcher's 2 ms sleep came back more than STALL_S late (a thread held the GIL,
  the process was stopped in the kernel, or no core was free): each thread's user and system
  CPU over it (10 ms clock ticks, from the last snapshot at most SNAPSHOT_S before; the
  kernel splits a thread's time into user and system by sampling at its tick, so over a
  0.1 s stall the split is approximate), the process's faults and context switches, the main
  thread's stack just after. An event loop that polls can also keep the watcher from the
  GIL; its thread then shows user time.
- `gc`: a collection of any generation that took GC_MS or more (it holds the GIL).
The snapshots cost the watched process a few per cent of one core (~1 ms per 40 threads).
"""

from __future__ import annotations

import collections
import gc
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import TextIO

STALL_WATCH_ENV = "DFLASH_STALL_WATCH"
TICK_S = 0.002
STALL_S = 0.03
SNAPSHOT_S = 0.02
GC_MS = 5.0
_CLOCK_TICK_MS = 1e3 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 10.0

_started: StallWatch | None = None


def start_if_enabled() -> StallWatch | None:
    """Start watching this process if DFLASH_STALL_WATCH is set (once per process)."""
    global _started
    directory = os.environ.get(STALL_WATCH_ENV)
    if not directory or _started is not None:
        return _started
    Path(directory).mkdir(parents=True, exist_ok=True)
    out = open(Path(directory) / f"{os.getpid()}.log", "a", buffering=1)  # noqa: SIM115
    _started = StallWatch(out)
    _started.start()
    return _started


def thread_times() -> dict[int, tuple[str, int, int]]:
    """{thread id: (kernel's thread name, user ticks, system ticks)} of this process's threads
    (empty where /proc is missing)."""
    times = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return times
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as stat:
                data = stat.read()
        except OSError:
            continue  # the thread ended
        close = data.rindex(b")")
        name = data[data.index(b"(") + 1 : close].decode(errors="replace")
        fields = data[close + 2 :].split()  # fields 3 (state) onwards: utime is 14, stime 15
        times[int(tid)] = (name, int(fields[11]), int(fields[12]))
    return times


def _usage() -> dict[str, float]:
    import resource  # POSIX only: imported when watching, not with the launcher

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "user_ms": usage.ru_utime * 1e3,
        "system_ms": usage.ru_stime * 1e3,
        "minor_faults": usage.ru_minflt,
        "major_faults": usage.ru_majflt,
        "voluntary_switches": usage.ru_nvcsw,
        "involuntary_switches": usage.ru_nivcsw,
    }


class StallWatch:
    """The watcher thread and the garbage collector's callback of one process. Only the
    watcher writes: the callback queues its record (a collection can start anywhere, also
    inside a write, where writing again would re-enter the file or wait on its own lock)."""

    def __init__(self, out: TextIO, stall_s: float = STALL_S, gc_ms: float = GC_MS) -> None:
        self.out = out
        self.stall_s = stall_s
        self.gc_ms = gc_ms
        self._collections: collections.deque[dict] = collections.deque()
        self._stop = threading.Event()
        self._gc_began = 0.0
        self._thread = threading.Thread(target=self._watch, name="stall-watch", daemon=True)

    def start(self) -> None:
        gc.callbacks.append(self._on_collection)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching; what was queued is written first."""
        self._stop.set()
        self._thread.join()
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)
        self._write_collections()

    def _write(self, record: dict) -> None:
        if not sys.is_finalizing():  # a daemon thread must not write during shutdown
            self.out.write(json.dumps({"at": round(time.time(), 3), **record}) + "\n")

    def _write_collections(self) -> None:
        while self._collections:
            self._write(self._collections.popleft())

    def _on_collection(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_began = time.perf_counter()
            return
        ms = (time.perf_counter() - self._gc_began) * 1e3
        if ms >= self.gc_ms:
            record = {"event": "gc", "generation": info["generation"], "ms": round(ms, 1)}
            self._collections.append(record | {"collected": info["collected"]})

    def _watch(self) -> None:
        last = time.perf_counter()
        snapshot, snapshot_at, usage = thread_times(), last, _usage()
        while not self._stop.wait(TICK_S):
            now = time.perf_counter()
            try:
                if now - last > self.stall_s + TICK_S:
                    self._report(now - last - TICK_S, snapshot, now - snapshot_at, usage)
                    snapshot, snapshot_at, usage = thread_times(), time.perf_counter(), _usage()
                elif now - snapshot_at >= SNAPSHOT_S:
                    snapshot, snapshot_at, usage = thread_times(), now, _usage()
                self._write_collections()
            except Exception as error:  # keep watching; say what went wrong
                self._write({"event": "error", "error": repr(error)})
            last = time.perf_counter()

    def _report(self, stall_s: float, before: dict, span_s: float, usage_before: dict) -> None:
        after, usage = thread_times(), _usage()
        python_names = {t.native_id: t.name for t in threading.enumerate()}
        threads = []
        for tid, (name, user, system) in after.items():
            _, user_before, system_before = before.get(tid, (name, 0, 0))
            if (user, system) != (user_before, system_before):
                threads.append(
                    {
                        "tid": tid,
                        "name": python_names.get(tid, name),
                        "user_ms": round((user - user_before) * _CLOCK_TICK_MS),
                        "system_ms": round((system - system_before) * _CLOCK_TICK_MS),
                    }
                )
        threads.sort(key=lambda t: -(t["user_ms"] + t["system_ms"]))
        main = sys._current_frames().get(threading.main_thread().ident)
        stack = [] if main is None else traceback.format_stack(main, limit=6)
        self._write(
            {
                "event": "stall",
                "ms": round(stall_s * 1e3, 1),
                "span_ms": round(span_s * 1e3, 1),  # what the thread times cover
                "threads": threads,
                "process": {k: round(usage[k] - usage_before[k], 1) for k in usage},
                "main_stack": [line.strip() for line in stack],
            }
        )
