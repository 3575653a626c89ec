"""A service's profile window is opened and closed by signals from another process
(`dflash_serve.loop_profile`, used by bench.trace_step --profile-services)."""

from __future__ import annotations

import asyncio
import os
import pstats
import signal

from dflash_serve import loop_profile


def counted_before_the_window():
    return sum(range(1000))


def counted_in_the_window():
    return sum(range(1000))


async def serve_then_signal(path: str) -> None:
    loop_profile.install_signal_toggle()
    counted_before_the_window()
    os.kill(os.getpid(), signal.SIGUSR1)
    await asyncio.sleep(0.05)  # the handler runs on the loop
    for _ in range(3):
        counted_in_the_window()
    os.kill(os.getpid(), signal.SIGUSR2)
    for _ in range(100):
        if os.path.exists(path):
            break
        await asyncio.sleep(0.01)
    counted_in_the_window()  # after the window: not counted


def test_signals_bound_the_profiled_window(tmp_path, monkeypatch):
    prefix = str(tmp_path / "profile")
    monkeypatch.setenv(loop_profile.PROFILE_ENV, prefix)
    path = loop_profile.stats_path(prefix, os.getpid())
    try:
        asyncio.run(serve_then_signal(path))
    finally:
        for sig in (signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)
    calls = {name: stats[1] for (_, _, name), stats in pstats.Stats(path).stats.items()}
    assert calls.get("counted_in_the_window") == 3
    assert "counted_before_the_window" not in calls


def test_without_the_variable_nothing_is_installed(monkeypatch):
    monkeypatch.delenv(loop_profile.PROFILE_ENV, raising=False)

    async def install():
        loop_profile.install_signal_toggle()
        return asyncio.get_running_loop()._signal_handlers.copy()

    assert asyncio.run(install()) == {}
