"""Pick `row_matmul`'s launch config per Qwen3.5-4B bf16 weight shape by measuring on this GPU.

Rows stay independent whatever is chosen, because the choice depends on the weight's shape
only. Candidates are compiled in parallel worker processes (they fill Triton's disk cache),
then timed one by one as CUDA graphs of 20 calls (GPU time, no launch overhead) at 16 rows
(one verify block) and 128 rows (8 blocks). The best by t16 + t128 / 4 is written to
dflash_serve/kernels/row_matmul_configs.json, with the machine, the timings and each entry's
commit. (4-bit weights read packed have their own kernel and tuner: bench.tune_w4a16.)

    python -m bench.tune_row_matmul [--jobs 16] [--row-tiles-only]
                                    [--against-tuned --block-ms 64]

`--row-tiles-only` keeps each tuned entry's tiles and split-K and sweeps its row tiles per
program only (1, 2, 4, 8 of 16 rows; 1, 2 of 64): a minute instead of five, for entries
tuned before row tiles existed. Row tiles change which rows share a weight tile, never a
row's arithmetic.
`--against-tuned` times each tuned entry against the sweep of `--block-ms` only (64: Hopper's
warpgroup MMA, rows in tiles of 64), keeping whichever wins.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import multiprocessing
import sys

import torch
import triton

from bench.timing import graph_us_per_call, run_facts
from dflash_serve.kernels.row_matmul import (
    TUNED_CONFIGS_PATH,
    MatmulConfig,
    config_key,
    row_matmul,
)

# (N, K) of Qwen3.5-4B's linears, the head, and the fused gate+up and GDN input projections.
SHAPES = [(8192, 2560), (1024, 2560), (2560, 4096), (4096, 2560), (32, 2560), (9216, 2560),
          (2560, 9216), (248320, 2560), (18432, 2560), (12352, 2560)]  # fmt: skip
CALLS_PER_GRAPH = 20


# Row tiles per program worth trying for each row-tile height: 64-row tiles hold 4x the
# accumulator registers of 16-row ones, and 128 rows (8 verify blocks) are 2 of them.
ROW_TILES_FOR_BLOCK_M = {16: (1, 2, 4, 8), 64: (1, 2)}


def candidates(
    n: int,
    k: int,
    block_ms: tuple[int, ...] = (16, 64),
    schedules: tuple[tuple[int, int], ...] = ((4, 3),),
    swaps: tuple[bool, ...] = (False,),
) -> list[MatmulConfig]:
    """Tile sizes, split-K and row tiles per program, each with every (warps, stages) of
    `schedules` and operand order of `swaps` (MatmulConfig.swap_ab). (32-wide tiles and
    BLOCK_K 32 never won in the earlier sweeps on the H200, f8a438b and 48f68c5, so they are
    left out; so were 8 warps.)"""
    configs = {}
    tilings = [(block_m, row_tiles) for block_m in block_ms
               for row_tiles in ROW_TILES_FOR_BLOCK_M[block_m]]  # fmt: skip
    shapes = itertools.product((64, 128), (64, 128), tilings, schedules, swaps)
    for block_n, block_k, (block_m, row_tiles), (warps, stages), swap_ab in shapes:
        if block_n > max(16, triton.next_power_of_2(n)) * 2:
            continue
        num_blocks = triton.cdiv(k, block_k)
        for wanted in (1, 2, 4, 8, 16):
            per_split = triton.cdiv(num_blocks, wanted)
            config = MatmulConfig.over_splits(
                k, block_n, block_k, per_split, row_tiles, block_m, warps, stages, swap_ab
            )
            configs[config] = None
    return list(configs)


def parse_schedules(text: str) -> tuple[tuple[int, int], ...]:
    """ "4x3,8x4" -> ((4, 3), (8, 4)): warps x pipeline stages."""
    schedules = []
    for item in text.split(","):
        warps, _, stages = item.partition("x")
        valid = warps.isdigit() and stages.isdigit() and int(stages) >= 1
        if not valid or int(warps) not in (1, 2, 4, 8, 16):
            raise ValueError(f"--schedules: WARPSxSTAGES items like 4x3, got {item!r}")
        schedules.append((int(warps), int(stages)))
    return tuple(schedules)


def row_tile_candidates(tuned: dict) -> list[MatmulConfig]:
    """A tuned entry with each number of row tiles per program."""
    base = MatmulConfig(**tuned)
    tiles = ROW_TILES_FOR_BLOCK_M[base.block_m]
    return [dataclasses.replace(base, row_tiles=count) for count in tiles]


def kind_of(config: MatmulConfig) -> str:
    """A candidate's family: operand order, warps x stages."""
    order = "swapped" if config.swap_ab else "plain"
    return f"{order}/{config.num_warps}x{config.num_stages}"


def best_by_kind(results: list[tuple[float, float, float, MatmulConfig]]) -> dict[str, dict]:
    """The fastest candidate of each family (results sorted best first): by how much the
    families that lost, lost."""
    best: dict[str, dict] = {}
    for _, t16, t128, config in results:
        best.setdefault(kind_of(config), {"us_16_rows": t16, "us_128_rows": t128})
    return best


def make_weight(n: int, k: int) -> torch.Tensor:
    return torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5


def compile_job(job) -> int:
    """Worker: run every candidate of one shape once (compiles into the disk cache)."""
    n, k, configs = job
    weight = make_weight(n, k)
    x = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
    for config in configs:
        row_matmul(x, weight, config=config)
    torch.cuda.synchronize()
    return len(configs)


def graph_us(x, weight, config) -> float:
    out = torch.empty(x.shape[0], weight.shape[0], device="cuda", dtype=torch.bfloat16)
    return graph_us_per_call(lambda _: row_matmul(x, weight, out, config), CALLS_PER_GRAPH)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=16)
    parser.add_argument("--row-tiles-only", action="store_true")
    parser.add_argument("--against-tuned", action="store_true",
                        help="each tuned entry against the sweep of --block-ms only")  # fmt: skip
    parser.add_argument("--block-ms", default="16,64", help="row-tile heights to sweep")
    parser.add_argument("--schedules", default="4x3",
                        help="warps x pipeline stages to sweep, e.g. 4x3,4x6,8x4")  # fmt: skip
    parser.add_argument("--operand-orders", default="plain",
                        help="plain (x·Wᵀ tiles), swapped (W·xᵀ tiles) or both")  # fmt: skip
    args = parser.parse_args()
    orders = args.operand_orders.split(",")
    if not orders or set(orders) - {"plain", "swapped"}:
        parser.error(f"--operand-orders: plain, swapped or both, got {args.operand_orders!r}")
    swaps = tuple(order == "swapped" for order in orders)
    try:
        schedules = parse_schedules(args.schedules)
    except ValueError as error:
        parser.error(str(error))
    block_ms = tuple(int(size) for size in args.block_ms.split(","))
    if set(block_ms) - set(ROW_TILES_FOR_BLOCK_M):
        parser.error(f"--block-ms: a comma-separated subset of 16,64, got {args.block_ms!r}")
    facts = run_facts("python -m bench.tune_row_matmul " + " ".join(sys.argv[1:]))
    kept = json.loads(TUNED_CONFIGS_PATH.read_text()) if TUNED_CONFIGS_PATH.exists() else {}
    sweep = functools.partial(candidates, block_ms=block_ms, schedules=schedules, swaps=swaps)
    tuned = kept.get("configs", {})
    if args.row_tiles_only:
        todo = [(n, k, row_tile_candidates(tuned[config_key(n, k)]))
                for n, k in SHAPES if config_key(n, k) in tuned]  # fmt: skip
    elif args.against_tuned:
        todo = [(n, k, [MatmulConfig(**tuned[key]), *sweep(n, k)])
                for n, k in SHAPES if (key := config_key(n, k)) in tuned]  # fmt: skip
    else:
        todo = [(n, k, sweep(n, k)) for n, k in SHAPES]
    context = multiprocessing.get_context("spawn")
    with context.Pool(args.jobs) as pool:
        print("compiled", sum(pool.map(compile_job, todo)), "candidates", flush=True)
    chosen = dict(tuned)  # entries of shapes not swept this time stay as measured before
    earlier = {"commit": kept.get("commit", "unknown")}
    timings = {key: earlier | kept.get("timings_us", {}).get(key, {}) for key in chosen}
    for n, k, configs in todo:
        weight = make_weight(n, k)
        rows = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in (16, 128)}
        results = []
        for config in configs:
            t16, t128 = graph_us(rows[16], weight, config), graph_us(rows[128], weight, config)
            results.append((t16 + t128 / 4, t16, t128, config))
        results.sort(key=lambda r: r[0])
        _, t16, t128, best = results[0]
        key = config_key(n, k)
        chosen[key] = dataclasses.asdict(best)
        timings[key] = {
            "commit": facts["commit"],
            "us_16_rows": t16,
            "us_128_rows": t128,
            "gbps_16_rows": weight.nbytes / t16 / 1e3,
            "candidates": len(results),
            "schedules": args.schedules,
            "operand_orders": args.operand_orders,
            "best_by_kind": best_by_kind(results),
        } | ({"swept": "row tiles only"} if args.row_tiles_only else {})
        if args.against_tuned:
            timings[key]["swept"] = f"the tuned entry against block_m {args.block_ms}"
        print(key, timings[key], chosen[key], flush=True)
    record = facts | {"configs": chosen, "timings_us": timings}
    if kept.get("note") and set(chosen) - {config_key(n, k) for n, k, _ in todo}:
        # each entry names its commit; the note says the rest
        record["note"] = kept["note"]
    TUNED_CONFIGS_PATH.write_text(json.dumps(record, indent=1) + "\n")
    print("wrote", TUNED_CONFIGS_PATH)


if __name__ == "__main__":
    main()
