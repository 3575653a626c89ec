"""The benchmark suite runs end to end (tiny shapes, CPU) and writes every promised key."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_suite_smoke_run_writes_the_results_schema(tmp_path):
    temp = tmp_path / "temp"  # where the suite writes its checkpoints
    temp.mkdir()
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.suite",
            "--smoke",
            "--out-dir",
            str(tmp_path),
            "--skip",
            "transformers",
            "--concurrency-rounds",
            "2",
            "--drafter-flags=--max-batch-size 1",  # reaches the service: its batches hold one
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env=os.environ | {"TMPDIR": str(temp), "DFLASH_STALL_WATCH": str(tmp_path / "stalls")},
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    assert not list(temp.glob("dflash-bench-*"))  # its checkpoints are removed after the run
    # The stall watch reaches the suite and every service it starts: a log per process.
    logs = list((tmp_path / "stalls").glob("*.log"))
    # The suite, its e2e client (a process of its own), target, drafter, the HTTP gateway.
    assert len(logs) == 5, logs
    for log in logs:
        for line in log.read_text().splitlines():
            assert json.loads(line)["event"] in {"stall", "gc"}
    results = json.loads((tmp_path / "latest.json").read_text())
    assert results["errors"] == {}
    assert results["e2e_client"] == "process"
    assert results["e2e_client_process"]["torch"] is False  # measured as the gateway runs
    assert results["e2e_service_flags"] == {"target": "", "drafter": "--max-batch-size 1"}
    for key in (
        "gpu",
        "date",
        "commit",
        "hbm_gbps",
        "layouts",
        "ar_tok_s",
        "e2e",
        "challenge_ms",
        "concurrency",
        "state_bytes_per_seq",
        "spec_equals_ar",
    ):
        assert key in results, key
    for layout in ("bf16", "int4_mlp", "int4_all"):
        assert {"verify_ms", "floor_ms", "draft_ms"} <= set(results["layouts"][layout])
    for tau in ("1", "3", "6", "10"):
        assert {"tok_s", "ttft_ms", "tpot_ms", "overhead_frac"} <= set(results["e2e"][tau])
        assert results["e2e"][tau]["equals_target_only"], "lossless on the CPU path"
    assert results["spec_equals_ar"]["batch1"]["equal"]
    assert results["spec_equals_ar"]["batch8"]["equal"]
    assert {"gateway_tok_s", "direct_tok_s", "http_overhead_ms_per_token"} <= set(results["http"])
    for count, entry in results["concurrency"].items():
        assert len(entry["rounds_tok_s"]) == 2
        assert entry["tok_s"] == min(entry["rounds_tok_s"]), "the lower middle of two rounds"
        for service in ("target", "drafter"):
            batching = entry["batching"][service]
            assert batching["batches"] > 0 and batching["inline_batches"] == 0  # CPU path
            assert 1 <= batching["mean_batch_size"] <= int(count), (count, batching)
        assert entry["batching"]["drafter"]["mean_batch_size"] == 1
        assert set(entry["split_waves"]) == {"prefill", "verify", "draft"}
        summaries = entry["round_summaries"]
        assert [s["tok_s"] for s in summaries] == entry["rounds_tok_s"]
        assert entry["first_round_summary"]["tok_s"] == entry["first_round_tok_s"]
        median = next(s for s in summaries if s["tok_s"] == entry["tok_s"])
        assert median["max_verify_wall_ms"] == entry["verify_ms"]["max_wall"]  # the same round's
        assert median["mean_open_ms"] == entry["mean_open_ms"]
        assert median["split_steps"] == {k: len(v) for k, v in entry["split_waves"].items()}
        slowest = median["slowest_steps"]["verify"]
        assert slowest["wall_ms"] == entry["verify_ms"]["max_wall"]
        assert 0 <= slowest["request"] < int(count) and slowest["batch_size"] >= 1
    assert (tmp_path / "latest.md").read_text().startswith("# Benchmark suite")


def test_split_waves_names_the_steps_whose_requests_did_not_share_a_forward():
    from bench.measure_e2e import split_waves

    # Four requests in lockstep: step 1 split 3 + 1, step 3 2 + 2, the rest shared.
    sizes = [[4, 3, 4, 2], [4, 3, 4, 2], [4, 3, 4, 2], [4, 1, 4, 2]]
    assert split_waves(sizes) == {"1": {3: 3, 1: 1}, "3": {2: 4}}
    assert split_waves([[1, 1, 1]]) == {}  # one request: every forward is its own


def test_a_concurrency_round_asks_the_target_for_its_facts_once_before_its_clock(monkeypatch):
    """As the gateway, which asks GetInfo once at start-up: not once per request, inside the
    measured round, where the calls spread the sessions' opens."""
    import asyncio
    import time
    from types import SimpleNamespace

    from bench import measure_e2e

    events = []

    class Target:
        async def info(self):
            events.append(("info", None))
            return SimpleNamespace(max_context_tokens=321)

    async def run_request(target, drafter, prompt, max_new, continuation=None, tau=None,
                          vocab=0, transport="inline", shared=None, max_context=None):  # fmt: skip
        events.append(("request", max_context))
        return measure_e2e.RequestResult([1, 2], 0.001, 0.002, measure_e2e.StepTimes(), 0.0)

    monkeypatch.setattr(measure_e2e, "run_request", run_request)
    perf_counter, clock_starts = time.perf_counter, []

    def recording_perf_counter():
        clock_starts.append(len(events))
        return perf_counter()

    monkeypatch.setattr(time, "perf_counter", recording_perf_counter)  # (measure_e2e's too)
    result = asyncio.run(
        measure_e2e.concurrent_throughput(Target(), None, [5], [], 6, 10, 3, 2, "inline", None)
    )
    assert [kind for kind, _ in events] == ["info", "request", "request", "request"]
    assert [value for kind, value in events if kind == "request"] == [321, 321, 321]
    assert clock_starts[0] == 1  # the round's clock started after the one GetInfo
    assert result["tok_s"] > 0


def test_median_round_reports_one_whole_round():
    from bench.e2e_client import median_round

    rounds = [{"tok_s": t, "verify_ms": {"max_wall": t / 10}} for t in (900.0, 300.0, 600.0)]
    assert median_round(rounds) == {"tok_s": 600.0, "verify_ms": {"max_wall": 60.0}}
    assert median_round(rounds[:2])["tok_s"] == 300.0
    assert median_round(rounds[:1])["tok_s"] == 900.0


def test_prefill_together_bench_times_shared_and_one_by_one_prefills(causal_lm_dir, monkeypatch):
    """bench.prefill_together's measurement on a tiny CPU engine: both ways run, and the
    shared way prefills the prompts in forwards of the engine's group size."""
    from bench.prefill_together import measure
    from target_service.engine import TargetEngine
    from target_service.model.loader import load_target_model
    from target_service.model.state import StateShape
    from tests.prefill_checks import record_padded_forwards

    model = load_target_model(causal_lm_dir)
    shape = StateShape(max_slots=4, max_len=64)
    engine = TargetEngine(model, shape, prefill_run_tokens=(16, 32), prefill_batch_rows=64)
    forwards = record_padded_forwards(monkeypatch)
    row = measure(engine, 20, 3, repeats=1)
    assert row["run_tokens"] == 32 and row["prompts_per_forward"] == 2
    assert row["shared_ms"] > 0 and row["one_by_one_ms"] > 0
    # Two warm-up runs and one timed run each way: shared in forwards of 2 + 1, then alone.
    assert forwards == [(2, 32), (1, 32)] * 3 + [(1, 32)] * 3 * 3
    assert engine.slots.num_active == 0

    forwards.clear()
    profiled = measure(engine, 20, 3, repeats=1, profile=True)["shared_profile"]
    assert forwards[-2:] == [(2, 32), (1, 32)]  # one more shared run, the profiled one
    assert len(forwards) == 2 * 3 + 3 * 3 + 2
    assert profiled["host_ms"] > 0 and profiled["gpu_ms"] == 0  # a CPU: no kernels
    assert engine.slots.num_active == 0


def test_a_round_summary_keeps_a_rounds_slowest_steps_and_its_split_waves():
    from bench.e2e_client import round_summary

    def steps(median, top):
        return {"median_wall": median, "max_wall": top, "median_forward": 1.0, "max_forward": 2.0}

    result = {
        "tok_s": 1051.2,
        "mean_ttft_ms": 16.5,
        "mean_open_ms": 1.7,
        "mean_decode_ms": 91.7,
        "prefill_ms": steps(14.7, 15.1),
        "verify_ms": steps(6.2, 131.0),
        "draft_ms": steps(2.1, 2.8),
        "verify_ms_after_first": steps(6.2, 6.4),
        "split_waves": {"prefill": {}, "verify": {"3": {3: 3, 1: 1}, "5": {2: 4}}, "draft": {}},
        "slowest_steps": {"prefill": None, "verify": {"request": 2, "step": 4}, "draft": None},
    }
    assert round_summary(result) == {
        "tok_s": 1051.2,
        "mean_open_ms": 1.7,
        "mean_ttft_ms": 16.5,
        "mean_decode_ms": 91.7,
        "max_prefill_wall_ms": 15.1,
        "max_verify_wall_ms": 131.0,
        "max_verify_wall_after_first_ms": 6.4,
        "max_draft_wall_ms": 2.8,
        "split_steps": {"prefill": 0, "verify": 2, "draft": 0},
        "slowest_steps": {"prefill": None, "verify": {"request": 2, "step": 4}, "draft": None},
    }


def test_the_slowest_step_is_named_by_request_and_step_with_its_forward_and_batch():
    from bench.measure_e2e import StepTimes, slowest_step

    first, second = StepTimes(), StepTimes()
    first.draft = [(2_000_000, 1_500_000), (3_100_000, 1_600_000)]
    first.batch_sizes["draft"] = [4, 4]
    second.draft = [(2_100_000, 1_500_000), (106_900_000, 1_700_000), (2_000_000, 1_400_000)]
    second.batch_sizes["draft"] = [4, 3, 4]
    assert slowest_step([first, second], "draft") == {
        "request": 1,
        "step": 1,
        "wall_ms": 106.9,
        "forward_ms": 1.7,
        "batch_size": 3,
    }
    assert slowest_step([first, second], "verify") is None  # no step of that kind


def test_the_report_names_rounds_far_below_the_median():
    from bench.report import markdown, slow_rounds

    def outline(tok_s):
        return {"tok_s": tok_s, "max_verify_wall_ms": 5.0}

    # The median (the entry's tok/s) is 2356.5: 0.8 x it is 1885.2, 0.8 x the mean 1521.
    rounds = [outline(1051.2), outline(2356.5), outline(1800.0), outline(1900.0), outline(2400.0)]
    entry = {"tok_s": 2356.5, "round_summaries": rounds}
    # Under 0.8 x the median, in the order they ran; 1900 is within 20 % of it.
    assert slow_rounds(entry) == [outline(1051.2), outline(1800.0)]
    assert slow_rounds({"tok_s": 800.0}) == []  # results written before the outlines
    report = markdown({"gpu": "cpu", "date": "2026-12-07 08:00 UTC", "commit": "x",
                       "torch": "2", "command": "c", "concurrency": {"4": entry}})  # fmt: skip
    lines = [line for line in report.splitlines() if "slow round" in line]
    assert lines == [
        '- 4 streams, a slow round: {"tok_s": 1051.2, "max_verify_wall_ms": 5.0}',
        '- 4 streams, a slow round: {"tok_s": 1800.0, "max_verify_wall_ms": 5.0}',
    ]
