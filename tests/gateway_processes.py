"""Start the whole product as real processes: target, drafter and gateway."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from launcher.service_processes import GATEWAY_LISTENING, ServiceProcess, start_service


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


def start_gateway(target_address, drafter_address, tokenizer, *extra, timeout_s=60.0):
    """The gateway as a process; returns once /health answers 200."""
    args = ["gateway", "--target-address", target_address, "--tokenizer", str(tokenizer), *extra]
    if drafter_address:
        args += ["--drafter-address", drafter_address]
    return start_service(args, timeout_s, wait_ready=wait_healthy, listening=GATEWAY_LISTENING)


def start_stack(target_dir, drafter_dir, *gateway_args):
    """(target, drafter, gateway) processes on the given checkpoints."""
    common = ["--max-sessions", "8", "--max-context-tokens", "512"]
    target = start_service(
        ["target", "--model", str(target_dir), "--drafter-model", str(drafter_dir), *common]
    )
    drafter = start_service(
        ["drafter", "--model", str(drafter_dir), "--target-model", str(target_dir), *common]
    )
    gateway = start_gateway(target.address, drafter.address, target_dir, *gateway_args)
    return target, drafter, gateway
