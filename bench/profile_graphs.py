"""Where the replayed CUDA graphs' GPU time goes, kernel by kernel: the target's verify graph
and the drafter's draft graph, as the services capture them, on 4B-shaped random weights.

Per graph: wall time per replay, kernels per replay, their summed GPU time (the gap to the
wall time is launch gaps inside the graph), and the kernels with the most GPU time, with
their count per replay. A diagnostic for choosing what to fuse, not a benchmark of record
(bench.suite is). Needs a GPU.

    python -m bench.profile_graphs [--layout bf16] [--verify-batches 1 8] [--draft-batches 1 8]
                                   [--int4-reads bf16 int4] [--pdl off on off on]
"""

from __future__ import annotations

import argparse
import collections
import os
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.measure_engine import BLOCK, build_drafter, build_target
from dflash_serve.checkpoint.synthetic import (
    DFLASH_4B,
    LAYOUTS,
    QWEN35_4B_TEXT,
    write_drafter,
    write_target,
)
from dflash_serve.kernels import programmatic_launch
from dflash_serve.layers.int4_reads import INT4_READS

PROFILED_REPLAYS = 5


def kernel_report(name: str, replay, top: int, timed_replays: int = 20) -> None:
    for _ in range(3):
        replay()
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(timed_replays):
        replay()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - began) / timed_replays * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_REPLAYS):
            replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for event in kernels:
        entry = by_name[event.name[:90]]
        entry[0] += 1
        entry[1] += event.device_time_total
    summed_ms = sum(total for _, total in by_name.values()) / PROFILED_REPLAYS / 1e3
    print(
        f"== {name}: wall {wall_ms:.3f} ms per replay; {len(kernels) / PROFILED_REPLAYS:.0f} "
        f"kernels per replay; their summed GPU time {summed_ms:.3f} ms",
        flush=True,
    )
    ranked = sorted(by_name.items(), key=lambda item: -item[1][1])[:top]
    for kernel, (count, total_us) in ranked:
        per_replay = total_us / PROFILED_REPLAYS
        print(f"  {per_replay:9.1f} us  x{count / PROFILED_REPLAYS:5.0f}  {kernel}", flush=True)


def profile_pass(args: argparse.Namespace, workdir: Path, target_dir: Path, label: str) -> None:
    """Every requested graph once, built afresh (launch options are fixed at capture)."""
    max_batch = max([1, *args.verify_batches, *args.draft_batches])
    for reads in args.int4_reads if args.verify_batches else ():
        taps = tuple(DFLASH_4B["dflash_config"]["target_layer_ids"])
        target = build_target(target_dir, max_batch, 1024, "cuda", taps, int4_reads=reads)
        for _ in range(max_batch):
            target.prefill(target.open_sequence(), [(i * 31) % 500 for i in range(512)])
        for batch in args.verify_batches:
            graph = target.graphs.graphs.captured[(batch, BLOCK)].graph
            name = f"verify graph, {args.layout}, int4 reads {reads}, batch {batch}{label}"
            kernel_report(name, graph.replay, args.top)
        del target
        torch.cuda.empty_cache()
    if args.draft_batches:
        drafter_dir = workdir / "d"
        if not drafter_dir.exists():
            write_drafter(drafter_dir, DFLASH_4B, device="cuda")
        drafter = build_drafter(drafter_dir, target_dir, max_batch, 1024, "cuda")
        for batch in args.draft_batches:
            graph = drafter.graphs.graphs.captured[batch].graph
            kernel_report(f"draft graph, batch {batch}{label}", graph.replay, args.top)
        del drafter
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layout", default="bf16", choices=LAYOUTS)
    parser.add_argument("--verify-batches", type=int, nargs="*", default=[1, 8])
    parser.add_argument("--draft-batches", type=int, nargs="*", default=[1, 8])
    parser.add_argument("--top", type=int, default=18)
    parser.add_argument("--int4-reads", nargs="*", default=[INT4_READS[0]], choices=INT4_READS,
                        help="what 4-bit layers read, one verify profile each")  # fmt: skip
    parser.add_argument("--pdl", nargs="*", default=[], choices=("on", "off"),
                        help="passes with programmatic dependent launch on or off, in this "
                        "order (off on off on); default: one pass, as DFLASH_PDL says")  # fmt: skip
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="dflash-graphs-"))
    target_dir = write_target(workdir / "t", QWEN35_4B_TEXT, args.layout, device="cuda")
    for pdl in args.pdl or [None]:
        if pdl is not None:
            os.environ["DFLASH_PDL"] = "1" if pdl == "on" else "0"
            programmatic_launch.cache_clear()
        label = f", PDL {'on' if programmatic_launch() else 'off'}"
        profile_pass(args, workdir, target_dir, label)


if __name__ == "__main__":
    main()
