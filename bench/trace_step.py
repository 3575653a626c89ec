"""Where a speculative step's time goes between the forwards: one timeline across the gateway
loop (this process), the gRPC transport, both servicers, both batchers and both engines.

Starts the two services with step tracing on (`dflash_serve.step_trace`), runs greedy requests
with an imposed acceptance τ for a while, merges the three processes' timestamps and prints,
for each consecutive pair of events of a step (gateway sends the draft … gateway receives the
verify), the median time between them; and per step its engines' time and the rest, the
orchestration the suite's `overhead` column reports (medians over steps). Inline batches
(the services' GPU fast path) mark their engine span on the event loop's thread. Results go
to a JSON file with the machine, date and command. The checkpoints are written by a spawned
process, so that this one, like the gateway, never holds a CUDA context.

    python -m bench.trace_step [--smoke] [--seconds 20] [--tau 6] [--layout bf16]
                               [--session-transport auto|grpc] [--streams 1]
                               [--profile-gateway N] [--profile-services N]

--streams N (above 1): N identical requests at once, in lockstep; instead of per-step gaps,
per wave (from one verify forward's end to the next) when each event first and last
happened: how long each process takes to hand on all N requests one after another.

--profile-gateway N: also profile this process (the gateway's loop and clients) with cProfile
over the measured requests and record its N functions of most own time, per step. The
profiler slows this process, so such a run's timeline is not comparable with one without.
--profile-services N: the same in the target and drafter services (`dflash_serve.loop_profile`:
signalled to start once the oracle request is done and to stop after the last measured one).

--smoke: tiny random models (runs on a CPU); otherwise the 4B-shaped random pair on the GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import cProfile
import itertools
import json
import multiprocessing
import os
import pstats
import shlex
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import measure_e2e
from bench.suite import SMOKE_DRAFTER, SMOKE_TARGET
from bench.timing import run_facts
from dflash_serve import loop_profile, step_trace
from dflash_serve.checkpoint.synthetic import (
    DFLASH_4B,
    LAYOUTS,
    QWEN35_4B_TEXT,
    write_drafter,
    write_target,
)
from dflash_serve.startup_heap import freeze_startup_objects

# One step, in the order it happens; the engines' time is thread_start → thread_end.
STEP_EVENTS = [
    "gateway.draft.send",
    "gateway.draft.sent",
    "drafter.received",
    "drafter.submit",
    "drafter-engine.queued",
    "drafter-engine.batch",
    "drafter-engine.thread_start",
    "drafter-engine.thread_end",
    "drafter-engine.resumed",
    "drafter-engine.resolved",
    "drafter.result",
    "gateway.draft.received",
    "gateway.verify.send",
    "gateway.verify.sent",
    "target.received",
    "target-engine.queued",
    "target-engine.batch",
    "target-engine.thread_start",
    "target-engine.thread_end",
    "target-engine.resumed",
    "target-engine.resolved",
    "target.result",
    "target.respond",
    "gateway.verify.received",
]
ENGINE_SPANS = (
    "drafter-engine.thread_start → drafter-engine.thread_end",
    "target-engine.thread_start → target-engine.thread_end",
)
DEFAULT_OUT = Path(__file__).parent / "results"


def read_timeline(prefix: str) -> list[tuple[int, str]]:
    events = []
    for path in Path(prefix).parent.glob(Path(prefix).name + ".*"):
        for line in path.read_text().splitlines():
            name, ns = line.split()
            events.append((int(ns), name))
    return sorted(events)


def step_segments(events: list[tuple[int, str]]) -> dict[str, list[float]]:
    """Microseconds between consecutive STEP_EVENTS, per step, and per step its whole time,
    its engines' time and the rest (orchestration); steps missing an event (the last, or
    one that raced another request's) are left out."""
    starts = [i for i, (_, name) in enumerate(events) if name == STEP_EVENTS[0]]
    segments: dict[str, list[float]] = {}
    for begin, end in itertools.pairwise(starts):
        first: dict[str, int] = {}
        for ns, name in events[begin:end]:
            first.setdefault(name, ns)
        if not all(name in first for name in STEP_EVENTS):
            continue
        for a, b in itertools.pairwise(STEP_EVENTS):
            segments.setdefault(f"{a} → {b}", []).append((first[b] - first[a]) / 1e3)
        step_us = (first[STEP_EVENTS[-1]] - first[STEP_EVENTS[0]]) / 1e3
        engines_us = sum(segments[span][-1] for span in ENGINE_SPANS)
        segments.setdefault("step", []).append(step_us)
        segments.setdefault("engines", []).append(engines_us)
        segments.setdefault("orchestration", []).append(step_us - engines_us)
    return segments


def wave_timeline(events: list[tuple[int, str]], streams: int) -> dict[str, list[float]]:
    """With `streams` requests in lockstep: per wave (the events after one target forward and
    up to the next), when each STEP_EVENTS event first and last happened, in microseconds
    after the forward ended. An event that happens once per request spreads over the wave as
    each process handles the requests one after another: the spread shows where serial
    per-request work stretches a step. Waves whose forward did not hold every request (a
    split wave, a prompt) are left out."""
    anchor = "target-engine.thread_end"
    ends = [i for i, (_, name) in enumerate(events) if name == anchor]
    timeline: dict[str, list[float]] = {}
    for begin, end in itertools.pairwise(ends):
        window = events[begin:end]
        seen: dict[str, list[int]] = {}
        for ns, name in window:
            seen.setdefault(name, []).append(ns)
        if len(seen.get("target.respond", [])) != streams:
            continue
        if any(name not in seen for name in STEP_EVENTS):
            continue
        origin = window[0][0]
        for name in STEP_EVENTS:
            timeline.setdefault(f"{name} first", []).append((seen[name][0] - origin) / 1e3)
            timeline.setdefault(f"{name} last", []).append((seen[name][-1] - origin) / 1e3)
    return timeline


def profile_per_step(profile: cProfile.Profile | str, steps: int, top: int) -> list[dict]:
    """The `top` functions of most own time in `profile` (a profiler or a stats file), per
    speculative step (a request's draft + verify): calls, own and cumulative microseconds."""
    rows = []
    for (path, line, name), (_, calls, own_s, cumulative_s, _) in pstats.Stats(
        profile
    ).stats.items():
        where = f"{Path(path).name}:{line}({name})" if line else name
        rows.append(
            {
                "function": where,
                "calls_per_step": round(calls / steps, 2),
                "own_us_per_step": round(own_s / steps * 1e6, 2),
                "cumulative_us_per_step": round(cumulative_s / steps * 1e6, 2),
            }
        )
    rows.sort(key=lambda row: row["own_us_per_step"], reverse=True)
    return rows[:top]


def signal_services(services, signal_number: int) -> None:
    for service in services:
        os.kill(service.process.pid, signal_number)


async def run_requests(target_address, drafter_address, args, vocab, profiler, services) -> int:
    from gateway.drafter_client import DrafterClient
    from gateway.target_client import TargetClient

    freeze_startup_objects()  # as the gateway does: no full collection mid-measurement
    sessions = args.session_transport
    target = TargetClient(target_address, session_transport=sessions)
    drafter = DrafterClient(drafter_address, session_transport=sessions)
    await target.info(), await drafter.info()
    args.sessions_on = f"{target.sessions.transport} / {drafter.sessions.transport}"
    transport = "inline" if args.smoke else "cuda_ipc"
    shared = await target.feature_buffer() if transport == "cuda_ipc" else None
    prompt = [(i * 7919) % vocab for i in range(64)]
    oracle = await measure_e2e.run_request(target, None, prompt, args.new_tokens)
    if services:
        signal_services(services, signal.SIGUSR1)
        await asyncio.sleep(0.2)  # (handled on the services' loops, between callbacks)
    began, steps = time.perf_counter(), 0
    while time.perf_counter() - began < args.seconds:
        if profiler is not None:
            profiler.enable()
        results = await asyncio.gather(
            *(
                measure_e2e.run_request(
                    target, drafter, prompt, args.new_tokens, oracle.tokens, args.tau, vocab,
                    transport, shared,
                )
                for _ in range(args.streams)
            )
        )  # fmt: skip
        if profiler is not None:
            profiler.disable()
        steps += sum(len(result.times.verify) for result in results)
    if services:
        signal_services(services, signal.SIGUSR2)
    await target.close()
    await drafter.close()
    return steps


def wait_for_file(path: str, timeout_s: float = 30.0) -> str:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no profile at {path} after {timeout_s:.0f} s")
        time.sleep(0.05)
    return path


def write_checkpoints(
    workdir: Path, target_config: dict, drafter_config: dict, layout: str, device: str
) -> tuple[Path, Path, int]:
    """The random target and drafter on disk, and the pid that wrote them."""
    target_dir = write_target(workdir / "t", target_config, layout, device=device)
    drafter_dir = write_drafter(workdir / "d", drafter_config, device=device)
    return target_dir, drafter_dir, os.getpid()


def write_checkpoints_elsewhere(*args) -> tuple[Path, Path, int]:
    """`write_checkpoints` in a spawned process: the loop measured here, like the gateway's,
    then runs in a process with no CUDA context and none of the GBs written on the GPU (the
    arrangement in which the suite's client had its slow rounds, bench/README)."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        return pool.submit(write_checkpoints, *args).result()


def main() -> None:
    from launcher.service_processes import start_service

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--tau", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument(
        "--streams",
        type=int,
        default=1,
        help="identical requests at once; above 1 the result is a per-wave timeline",
    )
    parser.add_argument("--layout", default="bf16", choices=LAYOUTS)
    parser.add_argument(
        "--session-transport",
        choices=("auto", "grpc"),
        default="auto",
        help="auto: the services' local session sockets; grpc: gRPC streams",
    )
    parser.add_argument(
        "--profile-gateway",
        type=int,
        default=0,
        metavar="N",
        help="profile this process (the gateway's side) and record its N costliest functions",
    )
    parser.add_argument(
        "--profile-services",
        type=int,
        default=0,
        metavar="N",
        help="profile the target and drafter services too and record their N costliest functions",
    )
    parser.add_argument("--out", type=Path, default=None, help="JSON file (default: results/)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        parser.error("the 4B-shaped models need a GPU; use --smoke on a CPU")
    workdir = Path(tempfile.mkdtemp(prefix="dflash-trace-"))
    target_config = SMOKE_TARGET if args.smoke else QWEN35_4B_TEXT
    drafter_config = SMOKE_DRAFTER if args.smoke else DFLASH_4B
    target_dir, drafter_dir, writer_pid = write_checkpoints_elsewhere(
        workdir, target_config, drafter_config, args.layout, device
    )
    prefix = str(workdir / "trace")
    step_trace.enable(prefix)
    profile_prefix = str(workdir / "profile")
    if args.profile_services:
        os.environ[loop_profile.PROFILE_ENV] = profile_prefix  # (the services inherit it)
    sessions = str(max(4, args.streams))
    common = ["--device", device, "--max-sessions", sessions, "--max-context-tokens", "2048"]
    target = start_service(
        ["target", "--model", str(target_dir), "--drafter-model", str(drafter_dir), *common]
    )
    drafter = start_service(
        ["drafter", "--model", str(drafter_dir), "--target-model", str(target_dir), *common]
    )
    try:
        vocab = target_config["vocab_size"]
        profiler = cProfile.Profile() if args.profile_gateway else None
        services = [target, drafter] if args.profile_services else []
        steps = asyncio.run(
            run_requests(target.address, drafter.address, args, vocab, profiler, services)
        )
        # (before run_facts, whose device name initialises CUDA here)
        loop_process = {"pid": os.getpid(), "cuda_initialized": torch.cuda.is_initialized()}
        service_stats = {
            name: wait_for_file(loop_profile.stats_path(profile_prefix, service.process.pid))
            for name, service in zip(("target", "drafter"), services, strict=False)
        }
    finally:
        target.stop()
        drafter.stop()
    events = read_timeline(prefix)
    if args.streams == 1:
        segments, unit = step_segments(events), "steps_traced"
    else:
        segments, unit = wave_timeline(events, args.streams), "waves_traced"
    medians = {name: round(statistics.median(values), 1) for name, values in segments.items()}
    results = run_facts("python -m bench.trace_step " + shlex.join(sys.argv[1:]))
    results |= {
        "models": "smoke" if args.smoke else f"4B-shaped random, {args.layout}",
        "tau": args.tau,
        "streams": args.streams,
        "sessions_on": args.sessions_on,  # target / drafter
        "checkpoint_writer_pid": writer_pid,
        "loop_process": loop_process,
        "steps": steps,
        unit: len(next(iter(segments.values()), [])),
        "median_us": medians,
    }
    if profiler is not None:
        results["gateway_profiled"] = True  # (slowed by the profiler: compare with care)
        results["gateway_profile_per_step"] = profile_per_step(
            profiler, steps, args.profile_gateway
        )
    for name, stats in service_stats.items():
        results[f"{name}_profile_per_step"] = profile_per_step(stats, steps, args.profile_services)
    print(f"sessions on (target / drafter): {args.sessions_on}; {unit}: {results[unit]}")
    for name, value in medians.items():
        print(f"{value:9.1f} us  {name}")
    for process in ("gateway", "target", "drafter"):
        for row in results.get(f"{process}_profile_per_step", []):
            print(f"{row['own_us_per_step']:9.1f} us own per step  {process}  {row['function']}")
    out = args.out
    if out is None:
        machine = results["gpu"].replace(" ", "-").lower()
        out = DEFAULT_OUT / f"trace-step-{results['date'].split()[0]}-{machine}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
