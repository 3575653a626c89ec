"""Where a process stops: a watcher thread that notices when it could not run for a while and
writes what every thread of the process did meanwhile.

Off unless the environment variable DFLASH_STALL_WATCH names a directory; then `start_if_enabled`
(called by the launcher's processes and by `bench.suite`; child processes inherit the variable)
writes JSON lines to `<dir>/<pid>.log`:
- `stall`: the watcher's 2 ms sleep came back more than `STALL_S` late. Something kept it from
  running: a thread holding the GIL (a long C call), the process stopped in the kernel, or no
  free core. The line gives each thread's user and system CPU time over the stall (from
  /proc/self/task, in 10 ms clock ticks, since the last snapshot at most `SNAPSHOT_S` before),
  the process's page faults and context switches, and the main thread's Python stack just
  after it. A stall in which one thread burned system time names that thread. An event loop
  that polls (the session sockets' readers) can also keep the watcher waiting for the GIL:
  such a report shows the loop's thread with user time.
- `gc`: a garbage collection of any generation that took `GC_MS` or more (it holds the GIL).
Why: the suite's concurrency rounds are sometimes 2-3x slower than the rest, with every
engine forward at its usual time (`bench/results/client-stalls-2026-12-07-nvidia-h100.json`);
the time is lost in one process, and this says which and in what.
"""

from __future__ import annotations

import gc
import json
import os
import resource
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
    """The watcher thread and the garbage collector's callback of one process."""

    def __init__(self, out: TextIO, stall_s: float = STALL_S, gc_ms: float = GC_MS) -> None:
        self.out = out
        self.stall_s = stall_s
        self.gc_ms = gc_ms
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._gc_began = 0.0
        self._thread = threading.Thread(target=self._watch, name="stall-watch", daemon=True)

    def start(self) -> None:
        gc.callbacks.append(self._on_collection)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)

    def _write(self, record: dict) -> None:
        if sys.is_finalizing():
            return  # a daemon thread must not write while the interpreter shuts down
        record = {"at": round(time.time(), 3), **record}
        with self._lock:
            self.out.write(json.dumps(record) + "\n")

    def _on_collection(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_began = time.perf_counter()
            return
        ms = (time.perf_counter() - self._gc_began) * 1e3
        if ms >= self.gc_ms:
            self._write(
                {
                    "event": "gc",
                    "generation": info["generation"],
                    "ms": round(ms, 1),
                    "collected": info["collected"],
                }
            )

    def _watch(self) -> None:
        last = time.perf_counter()
        snapshot, snapshot_at, usage = thread_times(), last, _usage()
        while not self._stop.wait(TICK_S):
            now = time.perf_counter()
            if now - last > self.stall_s + TICK_S:
                self._report(now - last - TICK_S, snapshot, now - snapshot_at, usage)
                snapshot, snapshot_at, usage = thread_times(), time.perf_counter(), _usage()
            elif now - snapshot_at >= SNAPSHOT_S:
                snapshot, snapshot_at, usage = thread_times(), now, _usage()
            last = time.perf_counter()

    def _report(self, stall_s: float, before: dict, span_s: float, usage_before: dict) -> None:
        after, usage = thread_times(), _usage()
        python_names = {t.native_id: t.name for t in threading.enumerate()}
        threads = []
        for tid, (name, user, system) in after.items():
            _, user_before, system_before = before.get(tid, (name, 0, 0))
            busy = (user - user_before, system - system_before)
            if any(busy):
                threads.append(
                    {
                        "tid": tid,
                        "name": python_names.get(tid, name),
                        "user_ms": round(busy[0] * _CLOCK_TICK_MS),
                        "system_ms": round(busy[1] * _CLOCK_TICK_MS),
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
