"""Where one speculative step's time goes, engine by engine, on the GPU fast path.

Builds the 4B-shaped target (taps for the drafter) and the DFlash drafter in this process,
prefills a 512-token prompt, then runs steps as the services do (drafter: add_context +
draft; target: verify_and_commit) timing each phase with the GPU synchronised, and prints a
torch.profiler table (CPU and CUDA) of a few steps. A diagnostic, not a benchmark of record.

    python -m bench.profile_step [--layout int4_mlp]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
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
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="dflash-step-"))
    target_dir = write_target(workdir / "t", QWEN35_4B_TEXT, args.layout, device="cuda")
    drafter_dir = write_drafter(workdir / "d", DFLASH_4B, device="cuda")
    taps = tuple(DFLASH_4B["dflash_config"]["target_layer_ids"])
    target = build_target(target_dir, 2, 2048, "cuda", taps)
    drafter = build_drafter(drafter_dir, target_dir, 2, 2048, "cuda")
    t_slot, d_slot = target.open_sequence(), drafter.open_sequence()
    prefill = target.prefill(t_slot, [(i * 7919) % 240000 for i in range(512)])
    features, anchor = prefill.taps, 7
    phases: dict[str, list[float]] = {"draft": [], "verify": []}

    def step(timed: bool) -> None:
        nonlocal features, anchor
        for name in phases:
            torch.cuda.synchronize()
            began = time.perf_counter()
            with record_function(name):
                if name == "draft":
                    request = DraftRequest(d_slot, features, anchor, 15)
                    drafts = add_context_and_draft(drafter, [request])[0].token_ids
                else:
                    block = [anchor, *drafts[:5], *[(d + 1) % 1000 for d in drafts[5:]]]
                    request = VerifyRequest(t_slot, block, SamplingParams())
                    result = verify_and_commit(target, [request])[0]
                    features, anchor = result.features, result.token_ids[-1]
            torch.cuda.synchronize()
            if timed:
                phases[name].append((time.perf_counter() - began) * 1e3)

    for _ in range(3):
        step(timed=False)
    for _ in range(args.num_steps):
        step(timed=True)
    for name, times in phases.items():
        print(f"{name}: median {statistics.median(times):.3f} ms", flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step(timed=False)
    for sort in ("cpu_time_total", "cuda_time_total"):
        print(prof.key_averages().table(sort_by=sort, row_limit=25), flush=True)


if __name__ == "__main__":
    main()
