"""GPU timing helpers: CUDA-event medians and the machine facts recorded with every result."""

from __future__ import annotations

import importlib.metadata
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch


def median_ms(fn: Callable[[], object], repeats: int = 20, warmup: int = 3) -> float:
    """Median wall time of fn() in ms, synchronising the GPU around each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize()
        began = time.perf_counter()
        fn()
        synchronize()
        times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def graph_us_per_call(call: Callable[[int], object], num_calls: int = 20) -> float:
    """Median GPU µs per call over 5 replays of one CUDA graph of call(0) … call(num_calls - 1)
    (no launch overhead between them); call(0) runs once first, outside the graph."""
    call(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for index in range(num_calls):
            call(index)
    graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) * 1e3 / num_calls)
    return sorted(times)[len(times) // 2]


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def hbm_bandwidth_gbps(device: str = "cuda", num_bytes: int = 4 * 1024**3) -> float:
    """Device-to-device copy bandwidth (read + write counted), the floor's denominator."""
    if device == "cpu":
        num_bytes = 256 * 1024**2
    source = torch.empty(num_bytes // 2, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    ms = median_ms(lambda: target.copy_(source), repeats=10)
    return 2 * source.numel() / (ms / 1e3) / 1e9


def run_facts(command: str) -> dict:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {
        "gpu": gpu,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": commit or "unknown",
        "command": command,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "grpc_experiments": os.environ.get("GRPC_EXPERIMENTS"),
        "fla_core": installed_version("fla-core"),
    }


def installed_version(distribution: str) -> str | None:
    """A package's installed version, None where it is absent: fla-core decides whether a
    GPU prefill runs the GDN rule in chunks or token by token (2× slower at 8192 tokens), so
    every record says which it measured."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
