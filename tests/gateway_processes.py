"""Start the whole product as real processes: target, drafter and gateway."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from launcher.service_processes import start_service

GATEWAY_LISTENING = re.compile(r"gateway listening on [\w.]+:(\d+)")


@dataclass
class Gateway:
    process: subprocess.Popen
    port: int
    log: list[str]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()


def start_gateway(target_address, drafter_address, tokenizer, *extra, timeout_s=60.0) -> Gateway:
    args = [
        "gateway",
        "--target-address",
        target_address,
        "--tokenizer",
        str(tokenizer),
        "--port",
        "0",
        *extra,
    ]
    if drafter_address:
        args += ["--drafter-address", drafter_address]
    process = subprocess.Popen(
        [sys.executable, "-m", "launcher.main", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    log: list[str] = []
    found: list[int] = []
    event = threading.Event()

    def pump() -> None:
        for line in process.stdout:
            log.append(line)
            match = GATEWAY_LISTENING.search(line)
            if match and not found:
                found.append(int(match.group(1)))
                event.set()

    threading.Thread(target=pump, daemon=True).start()
    if not event.wait(timeout_s):
        process.kill()
        raise RuntimeError("gateway did not start:\n" + "".join(log))
    gateway = Gateway(process, found[0], log)
    wait_healthy(gateway, timeout_s)
    return gateway


@dataclass(frozen=True)
class HttpResult:
    status: int
    text: str
    headers: dict[str, str]

    def json(self):
        import json

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


def wait_healthy(gateway: Gateway, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if http("GET", gateway.base_url + "/health", timeout_s=5).status == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError("gateway never became healthy:\n" + "".join(gateway.log))


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
