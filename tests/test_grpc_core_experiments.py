"""Every entry point runs gRPC with our choice of core experiments, made before grpc reads it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_serve.grpc_core_experiments import ENVIRONMENT_VARIABLE, FEWER_THREAD_HOPS

REPO = Path(__file__).resolve().parents[1]

# Imports `entry`, then grpc (if the entry did not), and prints GRPC_EXPERIMENTS as it was
# at the moment grpc was first imported: grpc reads it then and never again.
SEEN_AT_GRPC_IMPORT = """
import importlib, importlib.abc, os, sys

seen = []

class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "grpc" and not seen:
            seen.append(os.environ.get("GRPC_EXPERIMENTS", "<unset>"))
        return None

sys.meta_path.insert(0, Watch())
importlib.import_module(sys.argv[1])
import grpc
print(seen[0])
"""

# One real round trip on a server and channel of this process, under the environment's
# GRPC_EXPERIMENTS.
ROUND_TRIP = """
import asyncio
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

async def main():
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    await server.stop(None)
    print(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))

asyncio.run(main())
"""


def run_python(
    code: str, *args: str, experiments: str | None = None
) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != ENVIRONMENT_VARIABLE}
    if experiments is not None:
        env[ENVIRONMENT_VARIABLE] = experiments
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=120,
        check=True,
    )


@pytest.mark.parametrize(
    "entry",
    [
        "launcher.main",  # `dflash-serve`: every service and the gateway
        "bench.grpc_latency",  # imports grpc before dflash_serve
        "bench.suite",
    ],
)
def test_an_entry_point_chooses_the_experiments_before_grpc_is_imported(entry):
    seen = run_python(SEEN_AT_GRPC_IMPORT, entry).stdout.split()
    assert seen == [FEWER_THREAD_HOPS]


@pytest.mark.parametrize("theirs", ["", "-event_engine_client"])
def test_an_experiments_setting_in_the_environment_wins(theirs):
    seen = run_python(SEEN_AT_GRPC_IMPORT, "launcher.main", experiments=theirs).stdout
    assert seen.split() == ([theirs] if theirs else [])  # print("") prints an empty line


def test_this_grpc_knows_both_experiments_and_serves_with_them_off():
    """An upgrade of grpcio that dropped or renamed them would log 'Unknown experiment' and
    silently run its defaults."""
    finished = run_python(ROUND_TRIP, experiments=FEWER_THREAD_HOPS)
    assert finished.stdout.split() == ["SERVING"]
    assert "experiment" not in finished.stderr.lower()


def test_the_check_above_sees_an_unknown_experiment():
    finished = run_python(ROUND_TRIP, experiments="-no_such_experiment")
    assert "unknown experiment" in finished.stderr.lower()
