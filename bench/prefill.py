"""Prefill time of the 4B-shaped target at several prompt lengths (TTFT's main part), on the
plain-torch path and on the kernel path, with the gap between their last logits. The kernel
path is the service's: prompts up to 2,048 tokens replay a prefill graph; `kernels_eager`
runs them as eager forwards (`--prefill-graph-tokens ''`). Where fla-core is installed the
kernel path's GDN prefill is its chunked rule, and the token-by-token kernel is timed as
another path, eager (`kernels_token_loop`: graphs captured with fla-core would keep it).

python -m bench.prefill --out bench/results/prefill-h200.json [--lengths 64 2048 8192]
    [--paths kernels] [--profile]   (--profile: where one kernel-path prefill's time goes)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from functools import partial
from pathlib import Path

from bench.measure_engine import build_target
from bench.timing import median_ms, run_facts
from dflash_serve.checkpoint.synthetic import QWEN35_4B_TEXT, write_target
from target_service.config import DEFAULT_PREFILL_GRAPH_TOKENS
from target_service.model.gated_deltanet import GatedDeltaNet

LENGTHS = (64, 2048, 8192)
PATHS = ("plain", "kernels", "kernels_eager", "kernels_token_loop")
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaGraphLaunch")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--commit")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    results = run_facts("python -m bench.prefill " + " ".join(sys.argv[1:]))
    if args.commit:
        results["commit"] = args.commit
    model_dir = write_target(Path(tempfile.mkdtemp()) / "t", QWEN35_4B_TEXT, "bf16", device="cuda")
    prompts = {n: [(i * 7919) % 240000 for i in range(n)] for n in args.lengths}
    last_logits = {}
    for path in args.paths:
        engine = build_target(
            model_dir,
            1,
            max(args.lengths) + 16,
            fast_path=path != "plain",
            prefill_graph_tokens=DEFAULT_PREFILL_GRAPH_TOKENS if path == "kernels" else (),
        )
        layers = [m for m in engine.model.modules() if isinstance(m, GatedDeltaNet)]
        if path == "kernels":
            rule = layers[0].chunk_rule
            results["gdn_prefill_on_kernels"] = "token loop" if rule is None else rule.__module__
        if path == "kernels_token_loop":
            if layers[0].chunk_rule is None:
                break  # the kernel path already was the token loop
            for layer in layers:
                layer.chunk_rule = None
        results[f"prefill_ms_{path}"] = {}

        def prefill(length, engine=engine, path=path):
            slot = engine.open_sequence()
            last_logits[(path, length)] = engine.prefill(slot, prompts[length]).last_logits
            engine.close_sequence(slot)

        for length in args.lengths:  # first calls of a length compile and plan: not timed
            prefill(length)
        for length in args.lengths:
            ms = median_ms(partial(prefill, length), repeats=args.repeats, warmup=1)
            results[f"prefill_ms_{path}"][str(length)] = ms
            print(path, length, f"{ms:.1f} ms", flush=True)
        if args.profile and path == "kernels":
            results["profile"] = {
                str(n): profile_prefill(partial(prefill, n)) for n in args.lengths
            }
        del engine

    def gaps_to_plain(path: str) -> dict[str, float]:
        return {
            str(n): float((last_logits[(path, n)] - last_logits[("plain", n)]).abs().max())
            for n in args.lengths
        }

    gap_names = {"kernels": "kernels", "kernels_eager": "eager", "kernels_token_loop": "token_loop"}
    for path, name in gap_names.items():
        if {("plain", args.lengths[0]), (path, args.lengths[0])} <= last_logits.keys():
            results[f"max_logit_gap_{name}_vs_plain"] = gaps_to_plain(path)
    print(json.dumps(results, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))


def profile_prefill(run) -> dict:
    """Kernel launches, host time and GPU time of one call, with the GPU time by kernel
    (without a GPU: the host's side only, no kernels)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    on_gpu = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    synchronize = torch.cuda.synchronize if on_gpu else lambda: None
    synchronize()
    with profile(activities=activities) as prof:
        run()
        synchronize()
    events = prof.key_averages()
    sort_by = "cuda_time_total" if on_gpu else "self_cpu_time_total"
    print(events.table(sort_by=sort_by, row_limit=20), flush=True)
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    return {
        "launches": sum(e.count for e in events if e.key in LAUNCH_CALLS),
        "host_ms": sum(e.self_cpu_time_total for e in events) / 1e3,
        "gpu_ms": sum(e.self_device_time_total for e in kernels) / 1e3,
        "gpu_ms_by_kernel": {
            e.key[:60]: round(e.self_device_time_total / 1e3, 3)
            for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:12]
        },
    }


if __name__ == "__main__":
    main()
