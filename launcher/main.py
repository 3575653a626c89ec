"""`dflash-serve`: parses flags into one frozen config per command and runs it."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from dflash_serve import stall_watch
from dflash_serve.errors import DflashError
from dflash_serve.layers.int4_reads import INT4_READS, PREFILL_INT4_READS_DEFAULT
from dflash_serve.service_settings import DEFAULT_MAX_WAIT_US, DTYPE_CHOICES
from target_service.config import (
    DEFAULT_PREFILL_BATCH_ROWS,
    DEFAULT_PREFILL_CHUNK_TOKENS,
    DEFAULT_PREFILL_GRAPH_TOKENS,
)


def parse_ids(text: str) -> tuple[int, ...]:
    """'1,5,9' → (1, 5, 9)."""
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as error:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from error


def add_service_flags(parser: argparse.ArgumentParser, default_port: int) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=default_port, help="0 picks a free port")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="auto",
        help="auto: bf16 on GPU; on CPU fp32, but bf16 for the drafter on a CPU with native bf16",
    )
    parser.add_argument("--max-sessions", type=int, default=16, help="concurrent sessions (slots)")
    parser.add_argument("--max-context-tokens", type=int, default=4096, help="tokens per session")
    parser.add_argument("--max-batch-size", type=int, default=16, help="sessions per batched step")
    parser.add_argument(
        "--max-wait-us",
        type=int,
        help="how long a step waits at most for other sessions' requests (default: "
        + ", ".join(f"{name} {us}" for name, us in DEFAULT_MAX_WAIT_US.items())
        + ")",
    )
    parser.add_argument(
        "--max-gap-us",
        type=int,
        help="a step also stops waiting for other sessions' requests once none has come for "
        "this long (default: off)",
    )
    parser.add_argument(
        "--engine-threads",
        type=int,
        default=1,
        help="torch threads of the engine thread (1 is fastest for decoding on a CPU)",
    )
    parser.add_argument("--grace-period-s", type=float, default=5.0, help="drain time on SIGTERM")
    add_fast_path_flag(parser)
    parser.add_argument(
        "--session-socket",
        default="auto",
        help="also serve sessions on this local Unix socket (a gateway on this host uses it "
        "instead of gRPC): auto (a fresh path under the temp directory), a path, or off",
    )
    parser.add_argument(
        "--session-spin-us",
        type=int,
        help="how long a session on the local socket polls for its next request before "
        "sleeping (default: 20000 on the GPU fast path, else 0: spinning costs a core)",
    )
    parser.add_argument(
        "--gpu-memory-fraction", type=float, help="cap of this process's share of the GPU (0..1]"
    )


def add_fast_path_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--no-gpu-fast-path",
        dest="gpu_fast_path",
        action="store_false",
        help="on a GPU, run the plain-torch reference path instead of Triton kernels + graphs",
    )


def add_gateway_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="HTTP address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (0 picks a free one)")
    parser.add_argument("--served-model-name", default="dflash", help="the API's model id")
    parser.add_argument("--num-drafts", type=int, default=15, help="drafts per step (0..15)")
    parser.add_argument(
        "--no-adaptive-drafting",
        dest="adaptive_drafting",
        action="store_false",
        help="draft at every step, even while drafting does not pay for its cost",
    )
    parser.add_argument("--max-concurrent-requests", type=int, default=16)
    parser.add_argument("--max-queued-requests", type=int, default=64)
    parser.add_argument("--request-timeout-s", type=float, default=600.0)
    parser.add_argument(
        "--feature-transport", choices=("auto", "inline", "cuda_ipc"), default="auto"
    )
    parser.add_argument(
        "--session-transport",
        choices=("auto", "grpc"),
        default="auto",
        help="auto: sessions on a service's local session socket when it has one on this "
        "host, else gRPC; grpc: always gRPC",
    )
    parser.add_argument(
        "--session-spin-us",
        type=int,
        help="how long a session on the local socket polls for its next response before "
        "sleeping (default: as long as the service polls for requests, which it reports)",
    )


def gateway_config(args: argparse.Namespace, target: str, drafter: str | None, tokenizer: str):
    from gateway.config import GatewayConfig

    config = GatewayConfig(
        target_address=target,
        drafter_address=drafter,
        tokenizer_path=tokenizer,
        served_model_name=args.served_model_name,
        host=args.host,
        port=args.port,
        num_drafts=args.num_drafts,
        adaptive_drafting=args.adaptive_drafting,
        max_concurrent_requests=args.max_concurrent_requests,
        max_queued_requests=args.max_queued_requests,
        request_timeout_s=args.request_timeout_s,
        feature_transport=args.feature_transport,
        session_transport=args.session_transport,
        session_spin_us=args.session_spin_us,
    )
    config.validate()
    return config


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash-serve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    target = sub.add_parser("target", help="run the target gRPC service")
    target.add_argument("--model", required=True, help="Qwen3.5 checkpoint directory or hub id")
    taps = target.add_mutually_exclusive_group()
    taps.add_argument(
        "--tap-layer-ids", type=parse_ids, help="layers whose outputs the drafter reads"
    )
    taps.add_argument("--drafter-model", help="read the tap layers from this drafter's config")
    target.add_argument("--prefill-chunk-tokens", type=int, default=DEFAULT_PREFILL_CHUNK_TOKENS)
    target.add_argument(
        "--prefill-graph-tokens",
        type=parse_ids,
        default=DEFAULT_PREFILL_GRAPH_TOKENS,
        help="GPU fast path: prompts up to the longest of these lengths are prefilled from a "
        "CUDA graph of the next one, padded ('' turns them off; default "
        + ",".join(map(str, DEFAULT_PREFILL_GRAPH_TOKENS))
        + ")",
    )
    target.add_argument(
        "--prefill-batch-rows",
        type=int,
        default=DEFAULT_PREFILL_BATCH_ROWS,
        help="GPU fast path: prompts of sessions starting together share a prefill forward of "
        "up to this many rows, prompts × padded length, where the padded length is at most "
        f"the largest verify batch's rows (default {DEFAULT_PREFILL_BATCH_ROWS})",
    )
    target.add_argument(
        "--commit-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="GPU fast path: replay each commit (the accepted prefix's state) from a CUDA "
        "graph instead of eager launches (default on; see README)",
    )
    target.add_argument(
        "--int4-reads",
        choices=INT4_READS,
        default=INT4_READS[0],
        help="GPU verify/decode of 4-bit layers: read the packed 4 bits through the W4A16 "
        "kernel (the default: faster for one verify block on the H200, slower for 8 in the "
        "graph replays) or their dequantized bf16 copy; see README",
    )
    target.add_argument(
        "--prefill-int4-reads",
        choices=INT4_READS,
        default=PREFILL_INT4_READS_DEFAULT,
        help="the same for prefill forwards on the GPU kernels (prompts and prompt chunks "
        "up to the verify rows, alone or sharing a forward): the bf16 copy by default, "
        "faster at prefill's row counts; int4 needs --int4-reads int4; see README",
    )
    add_service_flags(target, 50051)

    drafter = sub.add_parser("drafter", help="run the DFlash drafter gRPC service")
    drafter.add_argument("--model", required=True, help="DFlash drafter directory or hub id")
    drafter.add_argument("--target-model", required=True, help="the target (embeddings, head)")
    add_service_flags(drafter, 50052)

    gateway = sub.add_parser("gateway", help="run the OpenAI-compatible HTTP gateway alone")
    gateway.add_argument("--target-address", required=True, help="HOST:PORT of the target")
    gateway.add_argument("--drafter-address", help="HOST:PORT of the drafter (else target-only)")
    gateway.add_argument("--tokenizer", required=True, help="the target checkpoint (tokenizer)")
    add_gateway_flags(gateway)

    up = sub.add_parser("up", help="start target, drafter and gateway on this machine")
    up.add_argument("--target", help="Qwen3.5 checkpoint (default: the embedded demo pair)")
    up.add_argument("--drafter", help="DFlash drafter checkpoint (omit for target-only)")
    up.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    up.add_argument("--max-context-tokens", type=int, default=4096)
    up.add_argument("--max-sessions", type=int, default=16)
    add_fast_path_flag(up)
    add_gateway_flags(up)

    inspect = sub.add_parser("inspect-target", help="load a checkpoint and print its shapes")
    inspect.add_argument("--model", required=True, help="checkpoint directory or hub id")
    inspect.add_argument("--dtype", choices=DTYPE_CHOICES[1:], default="float32")
    inspect.add_argument("--device", default="cpu")
    return parser


def service_settings(args: argparse.Namespace):
    from dflash_serve.service_settings import ServiceSettings

    return ServiceSettings(
        host=args.host,
        port=args.port,
        device=args.device,
        dtype=args.dtype,
        max_sessions=args.max_sessions,
        max_context_tokens=args.max_context_tokens,
        max_batch_size=args.max_batch_size,
        max_wait_us=args.max_wait_us,
        max_gap_us=args.max_gap_us,
        engine_threads=args.engine_threads,
        grace_period_s=args.grace_period_s,
        gpu_fast_path=args.gpu_fast_path,
        gpu_memory_fraction=args.gpu_memory_fraction,
        session_socket=args.session_socket,
        session_spin_us=args.session_spin_us,
    )


def run_target(args: argparse.Namespace) -> None:
    from target_service.config import TargetServiceConfig
    from target_service.server import serve

    taps = args.tap_layer_ids or ()
    if args.drafter_model:
        from dflash_serve.checkpoint.resolve import resolve_model_dir
        from drafter_service.model.config import load_dflash_config

        taps = load_dflash_config(resolve_model_dir(args.drafter_model)).target_layer_ids
    config = TargetServiceConfig(
        model=args.model,
        tap_layer_ids=tuple(taps),
        prefill_chunk_tokens=args.prefill_chunk_tokens,
        prefill_graph_tokens=args.prefill_graph_tokens,
        prefill_batch_rows=args.prefill_batch_rows,
        int4_reads=args.int4_reads,
        prefill_int4_reads=args.prefill_int4_reads,
        commit_graphs=args.commit_graphs,
        service=service_settings(args),
    )
    config.validate()
    asyncio.run(serve(config))


def run_drafter(args: argparse.Namespace) -> None:
    from drafter_service.config import DrafterServiceConfig
    from drafter_service.server import serve

    config = DrafterServiceConfig(
        model=args.model, target_model=args.target_model, service=service_settings(args)
    )
    config.validate()
    asyncio.run(serve(config))


def run_gateway(args: argparse.Namespace) -> None:
    from gateway.app import serve

    config = gateway_config(args, args.target_address, args.drafter_address, args.tokenizer)
    asyncio.run(serve(config, freeze_startup=True))


def run_up(args: argparse.Namespace) -> None:
    """Target and drafter as child processes, the gateway in this process."""
    from pathlib import Path

    from gateway.app import serve
    from launcher.embedded_default import embedded_model_pair
    from launcher.service_processes import start_service

    target, drafter = args.target, args.drafter
    if target is None:
        target, drafter = (str(p) for p in embedded_model_pair())
        print(f"no --target given: serving the embedded demo pair from {Path(target).parent}")
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    common = [
        "--device",
        device,
        "--max-context-tokens",
        str(args.max_context_tokens),
        "--max-sessions",
        str(args.max_sessions),
        *([] if args.gpu_fast_path else ["--no-gpu-fast-path"]),
    ]
    taps = ["--drafter-model", drafter] if drafter else []
    children = [start_service(["target", "--model", target, *taps, *common], echo=True)]
    try:
        if drafter:
            children.append(
                start_service(
                    ["drafter", "--model", drafter, "--target-model", target, *common], echo=True
                )
            )
        config = gateway_config(
            args, children[0].address, children[1].address if drafter else None, target
        )
        asyncio.run(serve(config, freeze_startup=True))
    finally:
        for child in children:
            child.stop()


def run_inspect_target(args: argparse.Namespace) -> None:
    import torch

    from target_service.engine import TargetEngine
    from target_service.model.loader import load_target_model
    from target_service.model.state import StateShape

    model = load_target_model(args.model, getattr(torch, args.dtype), args.device, True)
    config = model.config
    engine = TargetEngine(model, StateShape(max_slots=1, max_len=1))
    int4 = sum(1 for m in model.modules() if type(m).__name__ == "Int4Linear")
    print(
        f"layers: {config.num_hidden_layers} ({len(config.gdn_layer_ids)} GDN, "
        f"{len(config.attention_layer_ids)} attention); hidden {config.hidden_size}; "
        f"vocab {config.vocab_size}; 4-bit linear layers: {int4}"
    )
    for kind, nbytes in engine.state.bytes_per_sequence().items():
        print(f"state per sequence, {kind}: {nbytes / 2**20:.2f} MiB")


COMMANDS = {
    "target": run_target,
    "drafter": run_drafter,
    "gateway": run_gateway,
    "up": run_up,
    "inspect-target": run_inspect_target,
}


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    args = build_parser().parse_args(argv)
    stall_watch.start_if_enabled()  # DFLASH_STALL_WATCH: where a process stops, if it does
    try:
        COMMANDS[args.command](args)
    except DflashError as error:
        print(f"dflash-serve: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
