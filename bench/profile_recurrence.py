"""The GDN recurrence kernel's launch configurations, timed on Qwen3.5-4B's shapes.

Each (BLOCK_V, num_warps) is timed where serving runs the kernel: the verify of B
sequences × 16 tokens for one layer (inside the verify graph, 24 launches per step) and the
commit's replay of every layer's accepted prefix for B sequences in one launch (24·B rows,
fp32 recorded inputs, per-row counts). Beside each time: whether its states equal the
serving configuration's bit for bit (a configuration is only usable everywhere at once:
verify, decode and replay must share it). A diagnostic for choosing MAX_BLOCK_V/NUM_WARPS.

    python -m bench.profile_recurrence [--batches 1 8] [--out results.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import triton.testing

from bench.timing import run_facts
from target_service.kernels.gated_delta_recurrence import (
    MAX_BLOCK_V,
    NUM_WARPS,
    recurrent_gated_delta,
)

# Qwen3.5-4B's GDN layers: 16 key heads, 32 value heads, 128 × 128 state per value head.
KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM, GDN_LAYERS, BLOCK = 16, 32, 128, 128, 24, 16


def inputs(rows: int, dtype: torch.dtype, pool_rows: int, seed: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen, device="cuda").to(dtype)

    return {
        "q": randn(rows, BLOCK, KEY_HEADS, KEY_DIM, dtype=dtype),
        "k": randn(rows, BLOCK, KEY_HEADS, KEY_DIM, dtype=dtype),
        "v": randn(rows, BLOCK, VALUE_HEADS, VALUE_DIM, dtype=dtype),
        "g": -torch.rand(rows, BLOCK, VALUE_HEADS, generator=gen, device="cuda"),
        "beta": torch.rand(rows, BLOCK, VALUE_HEADS, generator=gen, device="cuda"),
        "pool": randn(pool_rows, VALUE_HEADS, KEY_DIM, VALUE_DIM) * 0.1,
        "slots": torch.randperm(pool_rows, generator=gen, device="cuda")[:rows],
    }


def verify_call(x: dict, launch, out: torch.Tensor):
    def call():
        recurrent_gated_delta(x["q"], x["k"], x["v"], x["g"], x["beta"], x["pool"],
                              x["final"], x["slots"], out=out, launch=launch)  # fmt: skip

    return call


def replay_call(x: dict, launch, counts: torch.Tensor):
    def call():
        recurrent_gated_delta(x["k"], x["k"], x["v"], x["g"], x["beta"], x["pool"],
                              x["final"], x["slots"], num_tokens=counts, launch=launch)  # fmt: skip

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--block-vs", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--warps", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--commit", help="commit to record (default: git rev-parse)")
    args = parser.parse_args()
    serving = (MAX_BLOCK_V, NUM_WARPS)
    configs = sorted(set(itertools.product(args.block_vs, args.warps)) | {serving})
    record = run_facts("python -m bench.profile_recurrence") | {"serving": list(serving)}
    record["commit"] = args.commit or record["commit"]
    record["rows"] = []
    for batch in args.batches:
        verify = inputs(batch, torch.bfloat16, 2 * batch, seed=batch)
        replay = inputs(GDN_LAYERS * batch, torch.float32, GDN_LAYERS * 2 * batch, seed=-batch)
        counts = torch.randint(1, BLOCK + 1, (GDN_LAYERS * batch,), device="cuda")
        counts = counts.to(torch.int32)
        verify_out = torch.empty_like(verify["v"], dtype=torch.float32)
        states, batch_rows = {}, []
        for launch in configs:
            row = {"batch": batch, "block_v": launch[0], "num_warps": launch[1]}
            calls = {
                "verify": (verify, verify_call(verify, launch, verify_out)),
                "replay": (replay, replay_call(replay, launch, counts)),
            }
            for name, (x, call) in calls.items():
                x["final"] = x["pool"].clone()
                call()
                states[(name, launch)] = x["final"][x["slots"]].clone()
                row[f"{name}_us"] = round(triton.testing.do_bench(call, warmup=5, rep=40) * 1e3, 1)
            batch_rows.append(row)
        for row in batch_rows:  # once the serving configuration's states exist
            launch = (row["block_v"], row["num_warps"])
            for name in ("verify", "replay"):
                row[f"{name}_equal_serving"] = torch.equal(
                    states[(name, launch)], states[(name, serving)]
                )
        record["rows"] += batch_rows
    for row in record["rows"]:
        mark = " (serving)" if (row["block_v"], row["num_warps"]) == serving else ""
        print(
            f"batch {row['batch']}: BLOCK_V {row['block_v']:3d} warps {row['num_warps']}: "
            f"verify {row['verify_us']:8.1f} µs/layer ({row['verify_equal_serving']}), "
            f"replay {row['replay_us']:8.1f} µs/step ({row['replay_equal_serving']}){mark}",
            flush=True,
        )
    if args.out:
        args.out.write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
