"""Profile a service process over a window that another process chooses, for
`bench.trace_step --profile-services`.

Off unless the environment variable DFLASH_LOOP_PROFILE names a file prefix: then SIGUSR1
starts cProfile and SIGUSR2 stops it and writes `<prefix>.<pid>.pstats`. The benchmark so
profiles only its measured requests, not loading, graph capture or warm-up, in the services it
started. The signals are handled on the service's event loop, between its callbacks.
"""

from __future__ import annotations

import asyncio
import cProfile
import os
import signal

PROFILE_ENV = "DFLASH_LOOP_PROFILE"


def stats_path(prefix: str, pid: int) -> str:
    return f"{prefix}.{pid}.pstats"


def install_signal_toggle() -> None:
    """On the running loop: SIGUSR1 starts profiling, SIGUSR2 stops and writes the stats
    (nothing when DFLASH_LOOP_PROFILE is unset)."""
    prefix = os.environ.get(PROFILE_ENV)
    if not prefix:
        return
    profiler = cProfile.Profile()

    def stop_and_write() -> None:
        profiler.disable()
        path = stats_path(prefix, os.getpid())
        profiler.dump_stats(path + ".part")
        os.replace(path + ".part", path)  # whole or absent, for the reader that waits on it

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, profiler.enable)
    loop.add_signal_handler(signal.SIGUSR2, stop_and_write)
