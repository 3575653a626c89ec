"""Prefill time of the 4B-shaped target at several prompt lengths (TTFT's main part).

python -m bench.prefill --out bench/results/prefill-h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from bench.timing import median_ms, run_facts
from dflash_serve.checkpoint.synthetic import QWEN35_4B_TEXT, write_target
from target_service.engine import TargetEngine
from target_service.model.loader import load_target_model
from target_service.model.state import StateShape

LENGTHS = (64, 2048, 8192)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--commit")
    args = parser.parse_args()
    results = run_facts("python -m bench.prefill " + " ".join(sys.argv[1:]))
    if args.commit:
        results["commit"] = args.commit
    model_dir = write_target(Path(tempfile.mkdtemp()) / "t", QWEN35_4B_TEXT, "bf16", device="cuda")
    engine = TargetEngine(
        load_target_model(model_dir, torch.bfloat16, "cuda"),
        StateShape(1, max(LENGTHS) + 16),
        prefill_chunk_tokens=2048,
    )
    results["prefill_ms"] = {}
    for length in LENGTHS:
        prompt = [(i * 7919) % 240000 for i in range(length)]

        def prefill(prompt=prompt):
            slot = engine.open_sequence()
            engine.prefill(slot, prompt)
            engine.close_sequence(slot)

        results["prefill_ms"][str(length)] = median_ms(prefill, repeats=3, warmup=1)
        print(length, results["prefill_ms"][str(length)], flush=True)
    print(json.dumps(results, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
