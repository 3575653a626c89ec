"""Sessions starting together: their prompts prefilled one after another against sharing
padded forwards (`TargetEngine.prefill_together`), on the 4B-shaped target built as the
service builds it (verify and prefill graphs, 16 slots: row kernels up to 256 rows).

For each prompt length and number of prompts, the time from the first prompt's start to the
last one's first token, through the target's batch function (`run_target_batch`: what the
batcher runs when the prompts arrive together) and through `prefill_and_choose` per prompt
(what ran before). `--prefill-batch-rows` is the service's flag: how many rows prompts of
one run length may share (run lengths up to the 256 rows the row kernels take; the shared
forward runs on them at any row count), so run the kernels' 256 beside a larger budget.
The single prompts of 256-1024 tokens show that longer prompts keep cuBLAS.
`--prefill-int4-reads` (the service's flag, one or both values: an A/B in one run) sets
what those forwards read for 4-bit layers.

python -m bench.prefill_together --out bench/results/prefill-together-h200.json
    [--lengths 32 64 128] [--counts 1 2 4 8] [--prefill-batch-rows 256 1024]
    [--layout int4_all] [--prefill-int4-reads int4 bf16] [--profile]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from bench.measure_engine import build_target
from bench.prefill import profile_prefill
from bench.timing import median_ms, run_facts
from dflash_serve.checkpoint.synthetic import LAYOUTS, QWEN35_4B_TEXT, write_target
from dflash_serve.layers.int4_reads import INT4_READS, PREFILL_INT4_READS_DEFAULT
from dflash_serve.speculative.types import SamplingParams
from target_service.config import DEFAULT_PREFILL_BATCH_ROWS
from target_service.speculative_step import PrefillRequest, prefill_and_choose, run_target_batch

MAX_SLOTS = 16


def measure(engine, length: int, count: int, repeats: int, profile: bool = False) -> dict:
    """ms to prefill `count` prompts of `length` tokens: shared forwards, then one by one;
    with `profile`, where one more shared run's time goes (bench.prefill.profile_prefill)."""
    vocab = engine.config.vocab_size
    prompts = [[(i * 7919 + j * 31) % vocab for i in range(length)] for j in range(count)]
    greedy = SamplingParams()
    slots = []

    def open_all():
        slots[:] = [engine.open_sequence() for _ in prompts]

    def close_all():
        for slot in slots:
            engine.close_sequence(slot)

    def shared():
        open_all()
        requests = [PrefillRequest(s, p, greedy) for s, p in zip(slots, prompts, strict=True)]
        steps = run_target_batch(engine, requests)
        close_all()
        for step in steps:
            if isinstance(step, BaseException):
                raise step

    def alone():
        open_all()
        for slot, prompt in zip(slots, prompts, strict=True):
            prefill_and_choose(engine, slot, prompt, greedy)
        close_all()

    probe = engine.open_sequence()
    run_tokens = engine.prefill_run_length(probe, length)
    engine.close_sequence(probe)
    row = {
        "run_tokens": run_tokens,
        "prompts_per_forward": engine.prefill_group_size(run_tokens) if run_tokens else 1,
        "shared_ms": round(median_ms(shared, repeats=repeats, warmup=2), 3),
        "one_by_one_ms": round(median_ms(alone, repeats=repeats, warmup=2), 3),
    }
    if profile:
        row["shared_profile"] = profile_prefill(shared)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--commit")
    parser.add_argument("--lengths", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--counts", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument(
        "--prefill-batch-rows",
        type=int,
        nargs="+",
        default=[MAX_SLOTS * 16, DEFAULT_PREFILL_BATCH_ROWS],
    )
    parser.add_argument("--layout", choices=LAYOUTS, default="int4_all")
    parser.add_argument("--solo-lengths", type=int, nargs="*", default=[256, 512, 1024])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also profile one shared run of each count x length (kernels by GPU time)",
    )
    parser.add_argument(
        "--prefill-int4-reads", choices=INT4_READS, nargs="+", default=[PREFILL_INT4_READS_DEFAULT]
    )
    args = parser.parse_args()
    results = run_facts("python -m bench.prefill_together " + " ".join(sys.argv[1:]))
    if args.commit:
        results["commit"] = args.commit
    results["layout"] = args.layout
    model_dir = write_target(
        Path(tempfile.mkdtemp()) / "t", QWEN35_4B_TEXT, args.layout, device="cuda"
    )
    for reads in args.prefill_int4_reads:
        by_reads = results.setdefault("prefill_int4_reads", {})[reads] = {}
        for rows in args.prefill_batch_rows:
            engine = build_target(
                model_dir, MAX_SLOTS, 2048 + 16, prefill_int4_reads=reads, prefill_batch_rows=rows
            )
            by_rows = by_reads.setdefault("prefill_batch_rows", {})[str(rows)] = {}
            for length in args.lengths:
                for count in args.counts:
                    row = measure(engine, length, count, args.repeats, args.profile)
                    by_rows[f"{count}x{length}"] = row
                    print(
                        f"{reads} reads, budget {rows} rows: {count} x {length} {row}", flush=True
                    )
            for length in args.solo_lengths:  # row kernels up to 256 rows, cuBLAS above
                row = measure(engine, length, 1, args.repeats)
                by_rows[f"1x{length}"] = row
                print(f"{reads} reads, budget {rows} rows: 1 x {length} {row}", flush=True)
            del engine
    print(json.dumps(results, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
