"""The benchmark's client runs in a process of its own, like the gateway without torch, and
hands back what it measured with the error that stopped it."""

from __future__ import annotations

import os
import socket

from bench import e2e_client
from bench.e2e_client import ClientPlan, measure, measure_in_own_process


def unused_address() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def plan_with_nothing_listening(tmp_path) -> ClientPlan:
    address = unused_address()  # nothing listens: the first call to the target fails
    return ClientPlan(address, address, tmp_path, vocab=16, transport="inline", new_tokens=4,
                      concurrency_rounds=1, challenge={64: 16}, concurrency=(1, 2))  # fmt: skip


def test_the_client_runs_in_another_process_without_torch(tmp_path):
    measured = measure_in_own_process(plan_with_nothing_listening(tmp_path))
    process = measured["results"].pop("e2e_client_process")
    assert process["pid"] != os.getpid()
    assert process["torch"] is False
    assert measured["results"] == {}
    assert "UNAVAILABLE" in measured["error"]
    assert "e2e_client.py" in measured["error"]  # raised in the client's own run


def test_the_plan_survives_its_trip_as_json(tmp_path):
    plan = plan_with_nothing_listening(tmp_path)
    assert e2e_client.plan_from_json(e2e_client.plan_to_json(plan)) == plan


def test_a_client_that_fails_halfway_keeps_what_it_measured(tmp_path, monkeypatch):
    async def half_a_run(self):
        self.results["e2e"] = {"1": {"tok_s": 1.0}}
        raise RuntimeError("the drafter went away")

    monkeypatch.setattr(e2e_client.E2EClient, "run", half_a_run)
    measured = measure(plan_with_nothing_listening(tmp_path))
    assert measured["results"]["e2e"] == {"1": {"tok_s": 1.0}}
    assert "RuntimeError: the drafter went away" in measured["error"]


def test_the_suite_keeps_a_failed_clients_partial_results_and_records_its_error(
    tmp_path, monkeypatch
):
    import argparse
    from types import SimpleNamespace

    import launcher.service_processes
    from bench import suite

    stopped = []
    monkeypatch.setattr(
        launcher.service_processes,
        "start_service",
        lambda args, **_: SimpleNamespace(address=args[0], stop=lambda: stopped.append(args[0])),
    )
    monkeypatch.setattr(
        suite,
        "measure_in_own_process",
        lambda plan: {
            "results": {"sessions_on": "unix"},
            "error": "Traceback: the drafter went away",
        },
    )
    args = argparse.Namespace(
        smoke=True, merge_into=None, commit=None, e2e_layout="bf16", e2e_int4_reads="int4",
        commit_graphs=False, target_flags="", drafter_flags="", new_tokens=4,
        concurrency_rounds=1, e2e_client="process", out_dir=tmp_path,
    )  # fmt: skip
    run = suite.Suite(args)
    run.dirs = {"bf16": tmp_path, "drafter": tmp_path}
    run.section("e2e", run.end_to_end)
    assert run.results["sessions_on"] == "unix"
    assert "the drafter went away" in run.results["errors"]["e2e"]
    assert sorted(stopped) == ["drafter", "target"]  # both services stopped after the failure
    run.workdir.rmdir()  # the suite's checkpoint directory, empty here
