"""The benchmark's client runs in a spawned process and hands back what it measured, with
the error that stopped it."""

from __future__ import annotations

import socket

from bench.e2e_client import ClientPlan, measure_in_own_process


def unused_address() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def test_a_client_that_fails_returns_its_error_and_partial_results(tmp_path):
    address = unused_address()  # nothing listens: the first call to the target fails
    plan = ClientPlan(address, address, tmp_path, vocab=16, transport="inline",
                      new_tokens=4, concurrency_rounds=1)  # fmt: skip
    measured = measure_in_own_process(plan)
    assert measured["results"] == {}
    assert "Traceback" in measured["error"]
    assert "e2e_client.py" in measured["error"]  # raised in the client's run, not by the pool
