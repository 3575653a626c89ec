"""Step tracing: off by default, one merged timeline when on, and every step's event fired by
the real services (bench.trace_step --smoke, CPU)."""

from __future__ import annotations

import json
import subprocess
import sys

from bench.trace_step import ENGINE_SPANS, STEP_EVENTS, step_segments
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
