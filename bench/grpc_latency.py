"""What one message on a session stream costs, outside our services: a diagnostic.

A server process answers the drafter's RunSession stream with an empty draft at once (no
engine, no batcher); the client ping-pongs `Draft` → `Drafted` on 1 and on 8 concurrent
streams and prints the median round trip and the messages per second, for each way of
writing the servicer and the client, over TCP loopback and a Unix socket:

- server `generator`: `async for` over the requests and `yield` the responses (our servicers);
  `read_write`: `await context.read()` / `await context.write()`;
- `raw`: no gRPC, length-prefixed protobuf over an asyncio Unix socket (the floor);
- client `sequential`: `await call.write()` then `await call.read()` (our clients);
  `overlapped`: the read is awaited while the write completes.

Both processes run with the GRPC_EXPERIMENTS of the environment, ours unless it sets one
(`dflash_serve/grpc_core_experiments.py`; `GRPC_EXPERIMENTS=` for grpc's defaults), and the
result records it.

The gap between these round trips and what `bench.trace_step` shows inside the services is
the servicers', batchers' and engines' share.

A last section pauses 0, 2 or 5 ms between round trips, as a speculative step does (each
side idles while the other computes), with each side asleep in its event loop or polling it.

    python -m bench.grpc_latency [--seconds 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from bench.timing import run_facts
from dflash_protos import drafter_pb2, drafter_pb2_grpc
from dflash_serve.grpc_support.server import CHANNEL_OPTIONS

CLIENT_STYLES = ("sequential", "overlapped")
STREAM_COUNTS = (1, 8)
DRAFTED = drafter_pb2.RunSessionResponse(drafted=drafter_pb2.Drafted(draft_ids=list(range(15))))


class GeneratorServicer(drafter_pb2_grpc.DrafterServiceServicer):
    async def RunSession(self, request_iterator, context):
        async for message in request_iterator:
            if message.WhichOneof("step") == "draft":
                yield DRAFTED


class ReadWriteServicer(drafter_pb2_grpc.DrafterServiceServicer):
    async def RunSession(self, request_iterator, context):
        while (message := await context.read()) is not grpc.aio.EOF:
            if message.WhichOneof("step") == "draft":
                await context.write(DRAFTED)


SERVICERS = {"generator": GeneratorServicer, "read_write": ReadWriteServicer}


async def spin_until_readable(reader: asyncio.StreamReader, num_bytes: int) -> None:
    """Poll the loop (select with no timeout) instead of sleeping in it until `num_bytes`
    are buffered: a thread that never sleeps wakes no slower for the next message."""
    while len(reader._buffer) < num_bytes and not reader.at_eof():
        await asyncio.sleep(0)


async def serve_raw(path: str, spin: bool = False) -> None:
    """The floor under any RPC layer: length-prefixed protobuf over an asyncio Unix socket."""

    async def session(reader, writer) -> None:
        try:
            while True:
                if spin:
                    await spin_until_readable(reader, 4)
                size = int.from_bytes(await reader.readexactly(4), "little")
                message = drafter_pb2.RunSessionRequest.FromString(await reader.readexactly(size))
                if message.WhichOneof("step") == "draft":
                    payload = DRAFTED.SerializeToString()
                    writer.write(len(payload).to_bytes(4, "little") + payload)
        except asyncio.IncompleteReadError:
            writer.close()

    server = await asyncio.start_unix_server(session, path)
    print(path, flush=True)
    async with server:
        await server.serve_forever()


async def serve(style: str, address: str) -> None:
    if style.startswith("raw"):
        await serve_raw(address.removeprefix("unix:"), spin=style == "raw-spin")
        return
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    drafter_pb2_grpc.add_DrafterServiceServicer_to_server(SERVICERS[style](), server)
    port = server.add_insecure_port(address)
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


async def ping_pong(
    stub, client_style: str, seconds: float, times: list[float], gap_s: float = 0.0
) -> None:
    call = stub.RunSession()
    request = drafter_pb2.RunSessionRequest(draft=drafter_pb2.Draft(anchor_id=1, num_drafts=15))
    ends = time.perf_counter() + seconds
    while (began := time.perf_counter()) < ends:
        if client_style == "sequential":
            await call.write(request)
            await call.read()
        else:
            write = asyncio.ensure_future(call.write(request))
            await call.read()
            await write
        times.append(time.perf_counter() - began)
        if gap_s:
            await asyncio.sleep(gap_s)
    call.cancel()


async def raw_ping_pong(
    path: str, seconds: float, times: list[float], gap_s: float = 0.0, spin: bool = False
) -> None:
    reader, writer = await asyncio.open_unix_connection(path)
    payload = drafter_pb2.RunSessionRequest(
        draft=drafter_pb2.Draft(anchor_id=1, num_drafts=15)
    ).SerializeToString()
    ends = time.perf_counter() + seconds
    while (began := time.perf_counter()) < ends:
        writer.write(len(payload).to_bytes(4, "little") + payload)
        if spin:
            await spin_until_readable(reader, 4)
        size = int.from_bytes(await reader.readexactly(4), "little")
        drafter_pb2.RunSessionResponse.FromString(await reader.readexactly(size))
        times.append(time.perf_counter() - began)
        if gap_s:
            await asyncio.sleep(gap_s)
    writer.close()


async def measure_raw(
    path: str, streams: int, seconds: float, gap_s: float = 0.0, spin: bool = False
) -> dict:
    await raw_ping_pong(path, 0.3, [])
    per_stream: list[list[float]] = [[] for _ in range(streams)]
    began = time.perf_counter()
    await asyncio.gather(*(raw_ping_pong(path, seconds, t, gap_s, spin) for t in per_stream))
    return summary(per_stream, time.perf_counter() - began)


def summary(per_stream: list[list[float]], elapsed: float) -> dict:
    times = [t for stream in per_stream for t in stream]
    return {
        "round_trip_us": round(statistics.median(times) * 1e6, 1),
        "round_trips_per_s": round(len(times) / elapsed),
    }


async def measure(address: str, client_style: str, streams: int, seconds: float) -> dict:
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = drafter_pb2_grpc.DrafterServiceStub(channel)
        await ping_pong(stub, client_style, 0.3, [])  # warm-up
        per_stream: list[list[float]] = [[] for _ in range(streams)]
        began = time.perf_counter()
        await asyncio.gather(*(ping_pong(stub, client_style, seconds, t) for t in per_stream))
        elapsed = time.perf_counter() - began
    return summary(per_stream, elapsed)


def start_server(style: str, address: str) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "bench.grpc_latency", "--serve", style, address],
        stdout=subprocess.PIPE,
        text=True,
    )
    port = process.stdout.readline().strip()
    if address.startswith("unix:"):
        return process, address
    return process, f"127.0.0.1:{port}"


def idle_gaps(socket_dir: Path, seconds: float, results: dict) -> None:
    """One stream with a pause between round trips, as a speculative step has (each side
    idles while the other computes): asleep in the loop, or polling it (spin)."""
    for gap_ms in (0.0, 2.0, 5.0):
        process, address = start_server("generator", "127.0.0.1:0")
        try:
            case = {"transport": "tcp", "server": "generator", "gap_ms": gap_ms}
            case |= asyncio.run(measure_with_gap(address, gap_ms / 1e3))
            results["cases"].append(case)
            print(f"gRPC, {gap_ms} ms between round trips: {case['round_trip_us']:7.1f} us")
        finally:
            process.terminate()
            process.wait()
        for server_spin in (False, True):
            style = "raw-spin" if server_spin else "raw"
            process, address = start_server(style, f"unix:{socket_dir}/{style}-{gap_ms}.sock")
            try:
                for client_spin in (False, True):
                    path = address.removeprefix("unix:")
                    case = {
                        "transport": "unix, no gRPC",
                        "gap_ms": gap_ms,
                        "server_spins": server_spin,
                        "client_spins": client_spin,
                    }
                    case |= asyncio.run(measure_raw(path, 1, seconds, gap_ms / 1e3, client_spin))
                    results["cases"].append(case)
                    print(
                        f"unix, no gRPC, {gap_ms} ms between round trips, server "
                        f"{'spins' if server_spin else 'sleeps'}, client "
                        f"{'spins' if client_spin else 'sleeps'}: {case['round_trip_us']:7.1f} us"
                    )
            finally:
                process.terminate()
                process.wait()


async def measure_with_gap(address: str, gap_s: float) -> dict:
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = drafter_pb2_grpc.DrafterServiceStub(channel)
        times: list[float] = []
        began = time.perf_counter()
        await ping_pong(stub, "sequential", 2.0, times, gap_s)
        return summary([times], time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--serve", nargs=2, metavar=("STYLE", "ADDRESS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(*args.serve))
        return
    socket_dir = Path(tempfile.mkdtemp(prefix="dflash-grpc-"))
    results = run_facts("python -m bench.grpc_latency " + " ".join(sys.argv[1:]))
    results["cases"] = []
    for transport in ("tcp", "unix"):
        for server_style in SERVICERS:
            bind = (
                f"unix:{socket_dir}/{server_style}.sock" if transport == "unix" else "127.0.0.1:0"
            )
            process, address = start_server(server_style, bind)
            try:
                for client_style in CLIENT_STYLES:
                    for streams in STREAM_COUNTS:
                        case = {
                            "transport": transport,
                            "server": server_style,
                            "client": client_style,
                            "streams": streams,
                        }
                        case |= asyncio.run(measure(address, client_style, streams, args.seconds))
                        results["cases"].append(case)
                        print(
                            f"{transport:4} server {server_style:10} client {client_style:10} "
                            f"{streams} stream(s): round trip {case['round_trip_us']:7.1f} us, "
                            f"{case['round_trips_per_s']:6d} round trips/s",
                            flush=True,
                        )
            finally:
                process.terminate()
                process.wait()
    process, address = start_server("raw", f"unix:{socket_dir}/raw.sock")
    try:
        for streams in STREAM_COUNTS:
            case = {"transport": "unix, no gRPC", "server": "asyncio", "streams": streams}
            case |= asyncio.run(measure_raw(address.removeprefix("unix:"), streams, args.seconds))
            results["cases"].append(case)
            print(
                f"unix, no gRPC (asyncio streams) {streams} stream(s): round trip "
                f"{case['round_trip_us']:7.1f} us, {case['round_trips_per_s']:6d} round trips/s"
            )
    finally:
        process.terminate()
        process.wait()
    idle_gaps(socket_dir, args.seconds, results)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
