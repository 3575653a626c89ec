"""Where a verify step's GPU time goes on the kernel path: per-kernel CUDA time of one eager
step (torch.profiler), then the replayed CUDA graph's step time, for each layout.

A diagnostic for tuning the fast path, not a benchmark of record (bench.suite is).

    python -m bench.profile_verify [--layouts int4_mlp bf16] [--batch 1]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.measure_engine import BLOCK, build_target
from bench.timing import median_ms
from dflash_serve.checkpoint.synthetic import LAYOUTS, QWEN35_4B_TEXT, write_target


def kernel_table(engine, slots, blocks, top: int) -> str:
    def step():
        engine.verify(slots, blocks)
        for slot in slots:
            engine.commit(slot, 1)

    # Eager, verify and commit: kernels by name, not one graph.
    graphs, commit_graphs = engine.graphs, engine.commit_graphs
    engine.graphs = engine.commit_graphs = None
    step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    engine.graphs, engine.commit_graphs = graphs, commit_graphs
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layouts", nargs="+", default=["int4_mlp"], choices=LAYOUTS)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="dflash-profile-"))
    for layout in args.layouts:
        model_dir = write_target(workdir / layout, QWEN35_4B_TEXT, layout, device="cuda")
        profile_layout(layout, model_dir, args.batch, args.top)
        torch.cuda.empty_cache()


def profile_layout(layout: str, model_dir: Path, batch: int, top: int) -> None:
    engine = build_target(model_dir, batch, 1024)
    slots = [engine.open_sequence() for _ in range(batch)]
    for slot in slots:
        engine.prefill(slot, [(i * 31) % 500 for i in range(512)])
    blocks = [[(i * 7 + j) % 500 for j in range(BLOCK)] for i in range(batch)]
    print(f"== {layout}, batch {batch}: eager kernel path, one step", flush=True)
    print(kernel_table(engine, slots, blocks, top), flush=True)

    def graphed():
        engine.verify(slots, blocks)
        for slot in slots:
            engine.commit(slot, 1)

    def replay_only():
        engine.graphs.graphs.captured[(batch, BLOCK)].graph.replay()

    print(
        f"{layout}: verify+commit {median_ms(graphed):.3f} ms, "
        f"graph replay alone {median_ms(replay_only):.3f} ms",
        flush=True,
    )


if __name__ == "__main__":
    main()
