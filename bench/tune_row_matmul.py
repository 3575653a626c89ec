"""Pick `row_matmul`'s launch config per Qwen3.5-4B weight shape by measuring on this GPU.

Rows stay independent whatever is chosen, because the choice depends on the weight's shape
and kind only. Candidates are compiled in parallel worker processes (they fill Triton's disk
cache), then timed one by one as CUDA graphs of 20 calls (GPU time, no launch overhead) at
16 rows (one verify block) and 128 rows (8 blocks). The best by t16 + t128 / 4 is written to
dflash_serve/kernels/row_matmul_configs.json, with the machine and the timings.

    python -m bench.tune_row_matmul [--jobs 16]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import sys

import torch
import triton

from bench.timing import run_facts
from dflash_serve.kernels.row_matmul import (
    TUNED_CONFIGS_PATH,
    MatmulConfig,
    RepackedInt4,
    config_key,
    row_matmul,
)

# (N, K) of Qwen3.5-4B's linears, the head, and the fused gate+up and GDN input projections.
DENSE_SHAPES = [(8192, 2560), (1024, 2560), (2560, 4096), (4096, 2560), (32, 2560), (9216, 2560),
                (2560, 9216), (248320, 2560), (18432, 2560), (12352, 2560)]  # fmt: skip
INT4_SHAPES = [shape for shape in DENSE_SHAPES if shape[0] != 248320]
GROUP = 128
CALLS_PER_GRAPH = 20


def candidates(n: int, k: int, group: int | None) -> list[MatmulConfig]:
    block_ks = (64, 128) if group is None else (32, 64, 128)
    configs = {}
    for block_n in (32, 64, 128):
        if block_n > max(16, triton.next_power_of_2(n)) * 2:
            continue
        for block_k in block_ks:
            num_blocks = triton.cdiv(k, block_k)
            for wanted in (1, 2, 4, 8, 16):
                per_split = triton.cdiv(num_blocks, wanted)
                split = triton.cdiv(num_blocks, per_split)
                config = MatmulConfig(
                    block_n=block_n,
                    block_k=block_k,
                    k_per_split=per_split * block_k,
                    split_k=split,
                    num_warps=4,
                    num_stages=3,
                )
                configs[config] = None
    return list(configs)


def make_weight(n: int, k: int, group: int | None):
    if group is None:
        return torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    return RepackedInt4(
        qweight=torch.randint(-(2**31), 2**31 - 1, (k // 8, n), device="cuda", dtype=torch.int32),
        scales=torch.rand(k // group, n, device="cuda") / 64,
        zeros=torch.randint(0, 16, (k // group, n), device="cuda", dtype=torch.uint8),
        out_features=n,
        in_features=k,
        group_size=group,
    )


def jobs() -> list[tuple[int, int, int | None]]:
    return [(n, k, None) for n, k in DENSE_SHAPES] + [(n, k, GROUP) for n, k in INT4_SHAPES]


def compile_job(job) -> int:
    """Worker: run every candidate of one shape once (compiles into the disk cache)."""
    n, k, group = job
    weight = make_weight(n, k, group)
    x = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
    for config in candidates(n, k, group):
        row_matmul(x, weight, config=config)
    torch.cuda.synchronize()
    return len(candidates(n, k, group))


def graph_us(x, weight, config) -> float:
    out = torch.empty(x.shape[0], weight.shape[0] if isinstance(weight, torch.Tensor)
                      else weight.out_features, device="cuda", dtype=torch.bfloat16)  # fmt: skip
    row_matmul(x, weight, out, config)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            row_matmul(x, weight, out, config)
    graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) * 1e3 / CALLS_PER_GRAPH)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=16)
    args = parser.parse_args()
    facts = run_facts("python -m bench.tune_row_matmul " + " ".join(sys.argv[1:]))
    context = multiprocessing.get_context("spawn")
    with context.Pool(args.jobs) as pool:
        print("compiled", sum(pool.map(compile_job, jobs())), "candidates", flush=True)
    chosen, timings = {}, {}
    for n, k, group in jobs():
        weight = make_weight(n, k, group)
        rows = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in (16, 128)}
        results = []
        for config in candidates(n, k, group):
            t16, t128 = graph_us(rows[16], weight, config), graph_us(rows[128], weight, config)
            results.append((t16 + t128 / 4, t16, t128, config))
        results.sort(key=lambda r: r[0])
        _, t16, t128, best = results[0]
        key = config_key(n, k, group)
        chosen[key] = dataclasses.asdict(best)
        bytes_read = weight.nbytes if group is None else n * k // 2
        timings[key] = {
            "us_16_rows": t16,
            "us_128_rows": t128,
            "gbps_16_rows": bytes_read / t16 / 1e3,
            "candidates": len(results),
        }
        print(key, timings[key], chosen[key], flush=True)
    record = facts | {"configs": chosen, "timings_us": timings}
    TUNED_CONFIGS_PATH.write_text(json.dumps(record, indent=1) + "\n")
    print("wrote", TUNED_CONFIGS_PATH)


if __name__ == "__main__":
    main()
