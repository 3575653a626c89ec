"""Where one speculative step's time goes, engine by engine, on the GPU fast path.

Builds the 4B-shaped target (taps for the drafter) and the DFlash drafter in this process,
prefills a 512-token prompt per sequence, then runs steps as the services do (drafter:
add_context + draft; target: verify_and_commit), all sequences batched, timing each phase
with the GPU synchronised, and prints a torch.profiler table (CPU and CUDA) of a few steps
and how much of a step the GPU was busy (the rest is host time the GPU waits through). A
diagnostic, not a benchmark of record.

    python -m bench.profile_step [--layout int4_mlp] [--batch 8] [--no-commit-graphs]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from bench.measure_engine import build_drafter, build_target
from dflash_serve.checkpoint.synthetic import (
    DFLASH_4B,
    LAYOUTS,
    QWEN35_4B_TEXT,
    write_drafter,
    write_target,
)
from dflash_serve.speculative.types import SamplingParams
from drafter_service.speculative_step import DraftRequest, add_context_and_draft
from target_service.speculative_step import VerifyRequest, verify_and_commit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layout", default="int4_mlp", choices=LAYOUTS)
    parser.add_argument("--num-steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=1, help="sequences per step")
    parser.add_argument(
        "--commit-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the service's flag",
    )
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="dflash-step-"))
    target_dir = write_target(workdir / "t", QWEN35_4B_TEXT, args.layout, device="cuda")
    drafter_dir = write_drafter(workdir / "d", DFLASH_4B, device="cuda")
    taps = tuple(DFLASH_4B["dflash_config"]["target_layer_ids"])
    slots_needed = max(2, args.batch)
    target = build_target(
        target_dir, slots_needed, 2048, "cuda", taps, commit_graphs=args.commit_graphs
    )
    drafter = build_drafter(drafter_dir, target_dir, slots_needed, 2048, "cuda")
    t_slots = [target.open_sequence() for _ in range(args.batch)]
    d_slots = [drafter.open_sequence() for _ in range(args.batch)]
    features, anchors = [], []
    for b, slot in enumerate(t_slots):
        prefill = target.prefill(slot, [(i * 7919 + b * 104729) % 240000 for i in range(512)])
        features.append(prefill.taps)
        anchors.append(7 + b)
    phases: dict[str, list[float]] = {"draft": [], "verify": []}

    def step(timed: bool) -> None:
        for name in phases:
            torch.cuda.synchronize()
            began = time.perf_counter()
            with record_function(name):
                if name == "draft":
                    requests = [
                        DraftRequest(d_slots[b], features[b], anchors[b], 15)
                        for b in range(args.batch)
                    ]
                    drafts = [d.token_ids for d in add_context_and_draft(drafter, requests)]
                else:
                    verify_requests = [
                        VerifyRequest(t_slots[b], block_of(anchors[b], drafts[b]), SamplingParams())
                        for b in range(args.batch)
                    ]
                    for b, result in enumerate(verify_and_commit(target, verify_requests)):
                        features[b], anchors[b] = result.features, result.token_ids[-1]
            torch.cuda.synchronize()
            if timed:
                phases[name].append((time.perf_counter() - began) * 1e3)

    for _ in range(3):
        step(timed=False)
    for _ in range(args.num_steps):
        step(timed=True)
    print(f"batch {args.batch}, layout {args.layout}", flush=True)
    for name, times in phases.items():
        print(f"{name}: median {statistics.median(times):.3f} ms", flush=True)
    profiled_steps = 3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(profiled_steps):
            step(timed=False)
    averages = prof.key_averages()
    for sort in ("cpu_time_total", "cuda_time_total"):
        print(averages.table(sort_by=sort, row_limit=25), flush=True)
    kernel_us = sum(e.self_device_time_total for e in averages if e.device_type == DeviceType.CUDA)
    for name in phases:
        wall_us = sum(e.cpu_time_total for e in averages if e.key == name)
        print(f"{name}: {wall_us / profiled_steps / 1e3:.3f} ms per profiled step", flush=True)
    print(f"GPU kernels: {kernel_us / profiled_steps / 1e3:.3f} ms per step", flush=True)


def block_of(anchor: int, drafts: list[int]) -> list[int]:
    """A verify block that agrees with the drafts for 5 tokens, then differs (random
    weights accept ~nothing anyway: the commit replays a prefix, as it mostly does)."""
    return [anchor, *drafts[:5], *[(d + 1) % 1000 for d in drafts[5:]]]


if __name__ == "__main__":
    main()
