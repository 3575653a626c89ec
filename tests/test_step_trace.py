"""Step tracing: off by default, one merged timeline when on, and every step's event fired by
the real services (bench.trace_step --smoke, CPU)."""

from __future__ import annotations

import cProfile
import json
import subprocess
import sys

from bench.trace_step import (
    ENGINE_SPANS,
    STEP_EVENTS,
    profile_per_step,
    step_segments,
    wave_timeline,
)
from dflash_serve import step_trace


def test_marks_go_to_a_file_per_process_only_when_enabled(tmp_path, monkeypatch):
    monkeypatch.setattr(step_trace, "_prefix", None)
    monkeypatch.setattr(step_trace, "_file", None)
    step_trace.mark("ignored")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(step_trace, "_prefix", str(tmp_path / "trace"))
    step_trace.mark("first")
    step_trace.mark("second")
    step_trace._file.close()
    (path,) = tmp_path.iterdir()
    lines = [line.split() for line in path.read_text().splitlines()]
    assert [name for name, _ in lines] == ["first", "second"]
    assert int(lines[0][1]) <= int(lines[1][1])


def test_segments_are_the_gaps_between_consecutive_events_of_complete_steps():
    def step(start_ns, gap_ns):
        return [(start_ns + i * gap_ns, name) for i, name in enumerate(STEP_EVENTS)]

    incomplete = [(900_000, STEP_EVENTS[0]), (900_500, STEP_EVENTS[1])]  # no verify: left out
    events = sorted(step(0, 1000) + step(100_000, 3000) + incomplete + step(200_000, 2000))
    segments = step_segments(events)
    first_gap = f"{STEP_EVENTS[0]} → {STEP_EVENTS[1]}"
    assert segments[first_gap] == [1.0, 3.0, 2.0]  # microseconds, one per complete step
    assert segments["step"] == [(len(STEP_EVENTS) - 1) * gap for gap in (1.0, 3.0, 2.0)]
    assert len(segments) == len(STEP_EVENTS) + 2  # every consecutive pair, step, its split
    engines = [sum(segments[span][i] for span in ENGINE_SPANS) for i in range(3)]
    assert segments["engines"] == engines
    assert segments["orchestration"] == [
        s - e for s, e in zip(segments["step"], engines, strict=True)
    ]


def test_wave_timeline_spreads_each_event_over_the_requests_of_one_wave():
    """Two requests in lockstep: each event once per request, the second 10 µs after the
    first, except the engines' (once per wave); a split wave is left out."""
    once = {name for name in STEP_EVENTS if name.startswith(("target-engine", "drafter-engine"))}
    anchor = STEP_EVENTS.index("target-engine.thread_end")
    order = STEP_EVENTS[anchor:] + STEP_EVENTS[:anchor]  # a wave starts at the forward's end

    def wave(start_ns, requests):
        events = []
        for i, name in enumerate(order):
            copies = 1 if name in once else requests
            events += [(start_ns + i * 1000 + r * 10_000, name) for r in range(copies)]
        return events

    events = sorted(wave(0, 2) + wave(1_000_000, 1) + wave(2_000_000, 2) + wave(3_000_000, 2))
    timeline = wave_timeline(events, streams=2)  # the last wave has no end: left out
    respond = order.index("target.respond")
    assert timeline["target.respond first"] == [respond * 1.0] * 2  # µs after the forward
    assert timeline["target.respond last"] == [respond * 1.0 + 10.0] * 2
    batch = order.index("drafter-engine.batch")
    assert timeline["drafter-engine.batch last"] == [batch * 1.0] * 2
    assert timeline["target-engine.thread_end first"] == [0.0, 0.0]
    assert len(timeline) == 2 * len(STEP_EVENTS)


def test_smoke_run_traces_every_event_of_a_step_in_the_real_services(tmp_path):
    out = tmp_path / "trace.json"
    command = [sys.executable, "-m", "bench.trace_step", "--smoke", "--seconds", "2"]
    completed = subprocess.run(
        [*command, "--out", str(out)], capture_output=True, text=True, timeout=600, check=False
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["steps_traced"] > 0 and results["steps_traced"] <= results["steps"]
    medians = results["median_us"]
    assert len(medians) == len(STEP_EVENTS) + 2
    assert 0 < medians["orchestration"] < medians["step"]
    assert 0 < medians["engines"] < medians["step"]
    for key in ("gpu", "date", "commit", "command"):
        assert results[key]
    assert results["checkpoint_writer_pid"] != results["loop_process"]["pid"]
    assert results["loop_process"]["cuda_initialized"] is False


def test_smoke_run_with_concurrent_streams_gives_a_wave_timeline(tmp_path):
    out = tmp_path / "trace.json"
    command = [sys.executable, "-m", "bench.trace_step", "--smoke", "--seconds", "2"]
    completed = subprocess.run(
        [*command, "--streams", "2", "--profile-gateway", "5", "--profile-services", "4",
         "--out", str(out)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["streams"] == 2 and results["waves_traced"] > 0
    medians = results["median_us"]
    assert len(medians) == 2 * len(STEP_EVENTS)
    assert medians["target-engine.thread_end first"] == 0.0
    for name in STEP_EVENTS:
        assert medians[f"{name} first"] <= medians[f"{name} last"]
    profile = results["gateway_profile_per_step"]
    assert results["gateway_profiled"] and len(profile) == 5
    assert all(row["calls_per_step"] > 0 and row["own_us_per_step"] > 0 for row in profile)
    for service in ("target", "drafter"):
        rows = results[f"{service}_profile_per_step"]
        assert len(rows) == 4 and all(row["calls_per_step"] > 0 for row in rows)


def test_a_gateway_profile_is_reported_per_step_costliest_first():
    def busy():
        total = 0
        for number in range(20_000):
            total += number
        return total

    def idle():
        return None

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(10):
        busy(), idle(), idle()
    profiler.disable()
    rows = profile_per_step(profiler, steps=10, top=50)
    by_name = {
        name: row
        for row in rows
        for name in ("busy", "idle")
        if row["function"].endswith(f"({name})")
    }
    assert by_name["busy"]["calls_per_step"] == 1 and by_name["idle"]["calls_per_step"] == 2
    assert rows[0] is by_name["busy"]
    assert by_name["busy"]["own_us_per_step"] > 100 * by_name["idle"]["own_us_per_step"]
    assert by_name["busy"]["cumulative_us_per_step"] >= by_name["busy"]["own_us_per_step"]
    assert profile_per_step(profiler, steps=10, top=1) == rows[:1]


def test_a_traced_process_marks_its_older_collections(tmp_path, monkeypatch):
    """A full collection stops every thread of a service: the trace must show when."""
    import gc

    monkeypatch.setattr(step_trace, "_prefix", None)
    monkeypatch.setattr(step_trace, "_file", None)
    monkeypatch.setenv(step_trace.TRACE_ENV, "")  # enable() sets it; restored after the test
    try:
        step_trace.enable(str(tmp_path / "trace"))
        step_trace.enable(str(tmp_path / "trace"))  # twice: still one callback
        assert gc.callbacks.count(step_trace._mark_collection) == 1
        gc.collect(0)
        gc.collect(2)
    finally:
        while step_trace._mark_collection in gc.callbacks:
            gc.callbacks.remove(step_trace._mark_collection)
    step_trace._file.close()
    (path,) = tmp_path.iterdir()
    names = [line.split()[0] for line in path.read_text().splitlines()]
    assert names == ["gc.start.gen2", "gc.stop.gen2"]
