"""Which gRPC C-core experiments our processes run with: its TCP connections without EventEngine.

Why: a speculative step sends four gRPC messages one after another (draft request and reply,
verify request and reply) when its session runs over gRPC streams. With the experiments
`event_engine_client` and `event_engine_listener` off, connections are made and accepted by
the core's older iomgr TCP code instead of EventEngine's, and a message costs less. On the
project's 2-core machine (grpcio 1.85.3,
bench/results/grpc-core-experiments-2026-12-05-cpu.json): a round trip on one stream 88-93
against 175-198 µs back to back, 137-236 against 214-313 µs with 2-5 ms of idling between
round trips as in a step (`bench.grpc_latency`); in whole steps over gRPC streams
(`bench.trace_step --smoke`) each message 15-60 µs faster and the orchestration 1072 / 1296
/ 1056 against 1376 / 1270 / 1253 µs a step (three runs each). On the H200 host
(grpc-core-experiments-2026-12-05-nvidia-h200.json): 73-75 against 244 µs back to back,
404-461 against 621 µs 5 ms apart, and orchestration 22.8 / 20.5 % of a step over gRPC
streams against 27.5 / 22.9 % (`bench.trace_step`, both orders). Our reading of why, not
checked in grpc's source: EventEngine reads a socket on threads of its own and hands the
completion on to the thread that grpc's asyncio integration polls, one more thread to wake
per message.

grpc reads GRPC_EXPERIMENTS once, when `grpc` is first imported (set after `import grpc`,
it changed nothing in a check made for this module), so this runs when `dflash_serve` is
imported, which every entry point (`dflash-serve`, `python -m bench.…`, the tests) does
before anything imports grpc. A GRPC_EXPERIMENTS already in the environment wins, an empty
one too (grpc's own defaults); processes started from ours inherit the choice through the
environment.
"""

from __future__ import annotations

import os

ENVIRONMENT_VARIABLE = "GRPC_EXPERIMENTS"
FEWER_THREAD_HOPS = "-event_engine_client,-event_engine_listener"


def choose_grpc_core_experiments() -> str:
    """Set GRPC_EXPERIMENTS to `FEWER_THREAD_HOPS` unless the environment already sets it;
    return the value in effect."""
    return os.environ.setdefault(ENVIRONMENT_VARIABLE, FEWER_THREAD_HOPS)
