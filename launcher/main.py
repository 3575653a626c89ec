"""`dflash-serve` entry point: parses flags into one frozen config per command and runs it."""

from __future__ import annotations

import argparse
import logging
import sys

from dflash_serve.errors import DflashError

logger = logging.getLogger("dflash-serve")

DTYPES = ("float32", "bfloat16", "float16")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash-serve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    inspect = sub.add_parser(
        "inspect-target", help="load a Qwen3.5 checkpoint and print its shapes and state sizes"
    )
    inspect.add_argument("--model", required=True, help="checkpoint directory or hub id")
    inspect.add_argument("--dtype", choices=DTYPES, default="float32")
    inspect.add_argument("--device", default="cpu")
    return parser


def run_inspect_target(args: argparse.Namespace) -> None:
    import torch

    from target_service.engine import TargetEngine
    from target_service.model.loader import load_target_model
    from target_service.model.state import StateShape

    model = load_target_model(
        args.model, getattr(torch, args.dtype), args.device, show_progress=True
    )
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


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = build_parser().parse_args(argv)
    try:
        if args.command == "inspect-target":
            run_inspect_target(args)
    except DflashError as error:
        print(f"dflash-serve: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
