"""Start services as real processes (`python -m launcher.main …`) and wait until they serve."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

LISTENING = re.compile(r"listening on [\w.]+:(\d+)")
# `up` also echoes its children's lines; only this one is the HTTP port.
GATEWAY_LISTENING = re.compile(r"gateway listening on [\w.]+:(\d+)")


@dataclass
class ServiceProcess:
    process: subprocess.Popen
    port: int
    log: list[str] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """For an HTTP process (the gateway)."""
        return f"http://{self.address}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()


def start_service(
    args: list[str],
    timeout_s: float = 600.0,
    echo: bool = False,
    wait_ready=None,
    listening: re.Pattern = LISTENING,
) -> ServiceProcess:
    """Run `dflash-serve ARGS --port 0`, return once it is ready: by default once its gRPC
    health check reports SERVING, else once `wait_ready(process, timeout_s)` returns.

    echo: copy the child's output to ours as it comes (progress while loading)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "launcher.main", *args, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    log: list[str] = []
    port_found = threading.Event()
    found: list[int] = []

    def pump() -> None:
        for line in process.stdout:
            log.append(line)
            if echo:
                sys.stderr.write(line)
            match = listening.search(line)
            if match and not found:
                found.append(int(match.group(1)))
                port_found.set()
        port_found.set()  # its output ended: it exited (no need to wait out the timeout)

    threading.Thread(target=pump, daemon=True).start()
    if not port_found.wait(timeout_s) or not found:
        process.kill()
        raise RuntimeError("service did not start:\n" + "".join(log))
    service = ServiceProcess(process, found[0], log)
    if wait_ready is None:
        wait_serving(service.address, timeout_s, service)
    else:
        wait_ready(service, timeout_s)
    return service


def wait_serving(address: str, timeout_s: float, service: ServiceProcess | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if service is not None and service.process.poll() is not None:
                raise RuntimeError("service exited:\n" + "".join(service.log))
            response = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            if response.status == health_pb2.HealthCheckResponse.SERVING:
                return
            time.sleep(0.1)
    raise TimeoutError(f"{address} did not become SERVING within {timeout_s} s")


@dataclass(frozen=True)
class HttpResult:
    status: int
    text: str
    headers: dict[str, str]

    def json(self):
        return json.loads(self.text)


def http(method: str, url: str, body: bytes | None = None, timeout_s: float = 60) -> HttpResult:
    """A plain HTTP request with the standard library (any status is returned, not raised)."""
    request = urllib.request.Request(
        url, data=body, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return HttpResult(response.status, response.read().decode(), dict(response.headers))
    except urllib.error.HTTPError as error:
        return HttpResult(error.code, error.read().decode(), dict(error.headers))


def wait_healthy(gateway: ServiceProcess, timeout_s: float) -> None:
    """Wait until an HTTP process (the gateway) answers 200 on /health."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if gateway.process.poll() is not None:
            raise RuntimeError("gateway exited:\n" + "".join(gateway.log))
        try:
            if http("GET", gateway.base_url + "/health", timeout_s=5).status == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError("gateway never became healthy:\n" + "".join(gateway.log))
