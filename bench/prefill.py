"""Prefill time of the 4B-shaped target at several prompt lengths (TTFT's main part), on the
plain-torch path and on the kernel path, with the gap between their last logits.

python -m bench.prefill --out bench/results/prefill-h200.json [--lengths 64 2048 8192]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from bench.measure_engine import build_target
from bench.timing import median_ms, run_facts
from dflash_serve.checkpoint.synthetic import QWEN35_4B_TEXT, write_target

LENGTHS = (64, 2048, 8192)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--commit")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    results = run_facts("python -m bench.prefill " + " ".join(sys.argv[1:]))
    if args.commit:
        results["commit"] = args.commit
    model_dir = write_target(Path(tempfile.mkdtemp()) / "t", QWEN35_4B_TEXT, "bf16", device="cuda")
    last_logits = {}
    for path, is_fast in (("plain", False), ("kernels", True)):
        engine = build_target(model_dir, 1, max(args.lengths) + 16, fast_path=is_fast)
        results[f"prefill_ms_{path}"] = {}
        for length in args.lengths:
            prompt = [(i * 7919) % 240000 for i in range(length)]

            def prefill(prompt=prompt, engine=engine, length=length, path=path):
                slot = engine.open_sequence()
                last_logits[(path, length)] = engine.prefill(slot, prompt).last_logits
                engine.close_sequence(slot)

            ms = median_ms(prefill, repeats=args.repeats, warmup=1)
            results[f"prefill_ms_{path}"][str(length)] = ms
            print(path, length, f"{ms:.1f} ms", flush=True)
        del engine
    results["max_logit_gap_kernels_vs_plain"] = {
        str(n): float((last_logits[("kernels", n)] - last_logits[("plain", n)]).abs().max())
        for n in args.lengths
    }
    print(json.dumps(results, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
