"""Pick `row_matmul`'s launch config per Qwen3.5-4B weight shape by measuring on this GPU.

Rows stay independent whatever is chosen, because the choice depends on the weight's shape
and kind only. Candidates are compiled in parallel worker processes (they fill Triton's disk
cache), then timed one by one as CUDA graphs of 20 calls (GPU time, no launch overhead) at
16 rows (one verify block) and 128 rows (8 blocks). The best by t16 + t128 / 4 is written to
dflash_serve/kernels/row_matmul_configs.json, with the machine and the timings; `--kinds int4`
re-tunes only the 4-bit shapes and keeps the dense entries (each timing names its commit).

    python -m bench.tune_row_matmul [--jobs 16] [--kinds dense,int4] [--row-tiles-only]
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


# Row tiles per program worth trying for each row-tile height: 64-row tiles hold 4x the
# accumulator registers of 16-row ones, and 128 rows (8 verify blocks) are 2 of them.
ROW_TILES_FOR_BLOCK_M = {16: (1, 2, 4, 8), 64: (1, 2)}


def candidates(
    n: int,
    k: int,
    group: int | None,
    block_ms: tuple[int, ...] = (16, 64),
    schedules: tuple[tuple[int, int], ...] = ((4, 3),),
    swaps: tuple[bool, ...] = (False,),
    k_orders: tuple[bool, ...] = (False,),
) -> list[MatmulConfig]:
    """Tile sizes, split-K and row tiles per program, each with every (warps, stages) of
    `schedules`, operand order of `swaps` (MatmulConfig.swap_ab) and K order of `k_orders`
    (MatmulConfig.k_by_nibble, 4-bit tiles of 128 inputs only). (32-wide tiles and
    BLOCK_K 32 never won in the earlier sweeps on the H200, f8a438b and 48f68c5, so they are
    left out; so were 8 warps for dense weights.)"""
    configs = {}
    tilings = [(block_m, row_tiles) for block_m in block_ms
               for row_tiles in ROW_TILES_FOR_BLOCK_M[block_m]]  # fmt: skip
    shapes = itertools.product((64, 128), (64, 128), tilings, schedules, swaps, k_orders)
    for block_n, block_k, (block_m, row_tiles), (warps, stages), swap_ab, by_nibble in shapes:
        if block_n > max(16, triton.next_power_of_2(n)) * 2:
            continue
        if by_nibble and (group is None or block_k < 128):
            continue
        if group is not None and group % block_k:
            continue
        num_blocks = triton.cdiv(k, block_k)
        for wanted in (1, 2, 4, 8, 16):
            per_split = triton.cdiv(num_blocks, wanted)
            config = MatmulConfig.over_splits(
                k,
                block_n,
                block_k,
                per_split,
                row_tiles,
                block_m,
                warps,
                stages,
                swap_ab,
                by_nibble,
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
    """A candidate's family: operand order, K order, warps x stages."""
    order = "swapped" if config.swap_ab else "plain"
    k_order = "nibble" if config.k_by_nibble else "plain"
    return f"{order}/{k_order}/{config.num_warps}x{config.num_stages}"


def best_by_kind(results: list[tuple[float, float, float, MatmulConfig]]) -> dict[str, dict]:
    """The fastest candidate of each family (results sorted best first): by how much the
    families that lost, lost."""
    best: dict[str, dict] = {}
    for _, t16, t128, config in results:
        best.setdefault(kind_of(config), {"us_16_rows": t16, "us_128_rows": t128})
    return best


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


def jobs(kinds: tuple[str, ...]) -> list[tuple[int, int, int | None]]:
    dense = [(n, k, None) for n, k in DENSE_SHAPES] if "dense" in kinds else []
    return dense + ([(n, k, GROUP) for n, k in INT4_SHAPES] if "int4" in kinds else [])


def compile_job(job) -> int:
    """Worker: run every candidate of one shape once (compiles into the disk cache)."""
    n, k, group, configs = job
    weight = make_weight(n, k, group)
    x = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
    for config in configs:
        row_matmul(x, weight, config=config)
    torch.cuda.synchronize()
    return len(configs)


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
    parser.add_argument("--kinds", default="dense,int4", help="weight kinds to (re-)tune")
    parser.add_argument("--row-tiles-only", action="store_true")
    parser.add_argument("--against-tuned", action="store_true",
                        help="each tuned entry against the sweep of --block-ms only")  # fmt: skip
    parser.add_argument("--block-ms", default="16,64", help="row-tile heights to sweep")
    parser.add_argument("--schedules", default="4x3",
                        help="warps x pipeline stages to sweep, e.g. 4x3,4x6,8x4")  # fmt: skip
    parser.add_argument("--operand-orders", default="plain",
                        help="plain (x·Wᵀ tiles), swapped (W·xᵀ tiles) or both")  # fmt: skip
    parser.add_argument("--k-orders", default="plain",
                        help="4-bit tiles: plain, nibble (8 nibble-plane dots), both")  # fmt: skip
    args = parser.parse_args()
    orders = args.operand_orders.split(",")
    if not orders or set(orders) - {"plain", "swapped"}:
        parser.error(f"--operand-orders: plain, swapped or both, got {args.operand_orders!r}")
    swaps = tuple(order == "swapped" for order in orders)
    k_orders = args.k_orders.split(",")
    if not k_orders or set(k_orders) - {"plain", "nibble"}:
        parser.error(f"--k-orders: plain, nibble or both, got {args.k_orders!r}")
    by_nibble = tuple(order == "nibble" for order in k_orders)
    try:
        schedules = parse_schedules(args.schedules)
    except ValueError as error:
        parser.error(str(error))
    block_ms = tuple(int(size) for size in args.block_ms.split(","))
    if set(block_ms) - set(ROW_TILES_FOR_BLOCK_M):
        parser.error(f"--block-ms: a comma-separated subset of 16,64, got {args.block_ms!r}")
    kinds = tuple(args.kinds.split(","))
    if not kinds or set(kinds) - {"dense", "int4"}:
        parser.error(f"--kinds: a comma-separated subset of dense,int4, got {args.kinds!r}")
    facts = run_facts("python -m bench.tune_row_matmul " + " ".join(sys.argv[1:]))
    kept = json.loads(TUNED_CONFIGS_PATH.read_text()) if TUNED_CONFIGS_PATH.exists() else {}
    sweep = functools.partial(
        candidates, block_ms=block_ms, schedules=schedules, swaps=swaps, k_orders=by_nibble
    )
    if args.row_tiles_only:
        tuned = kept.get("configs", {})
        todo = [(n, k, g, row_tile_candidates(tuned[config_key(n, k, g)]))
                for n, k, g in jobs(kinds) if config_key(n, k, g) in tuned]  # fmt: skip
    elif args.against_tuned:
        tuned = kept.get("configs", {})
        todo = [(n, k, g, [MatmulConfig(**tuned[key]), *sweep(n, k, g)])
                for n, k, g in jobs(kinds) if (key := config_key(n, k, g)) in tuned]  # fmt: skip
    else:
        todo = [(n, k, g, sweep(n, k, g)) for n, k, g in jobs(kinds)]
    context = multiprocessing.get_context("spawn")
    with context.Pool(args.jobs) as pool:
        print("compiled", sum(pool.map(compile_job, todo)), "candidates", flush=True)
    keep = [key for key in kept.get("configs", {}) if key.split(":")[0] not in kinds]
    chosen = {key: kept["configs"][key] for key in keep}
    earlier = {"commit": kept.get("commit", "unknown")}
    timings = {key: earlier | kept.get("timings_us", {}).get(key, {}) for key in keep}
    for n, k, group, configs in todo:
        weight = make_weight(n, k, group)
        rows = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in (16, 128)}
        results = []
        for config in configs:
            t16, t128 = graph_us(rows[16], weight, config), graph_us(rows[128], weight, config)
            results.append((t16 + t128 / 4, t16, t128, config))
        results.sort(key=lambda r: r[0])
        _, t16, t128, best = results[0]
        key = config_key(n, k, group)
        chosen[key] = dataclasses.asdict(best)
        bytes_read = weight.nbytes if group is None else n * k // 2
        timings[key] = {
            "commit": facts["commit"],
            "us_16_rows": t16,
            "us_128_rows": t128,
            "gbps_16_rows": bytes_read / t16 / 1e3,
            "candidates": len(results),
            "schedules": args.schedules,
            "operand_orders": args.operand_orders,
            "k_orders": args.k_orders,
            "best_by_kind": best_by_kind(results),
        } | ({"swept": "row tiles only"} if args.row_tiles_only else {})
        if args.against_tuned:
            timings[key]["swept"] = f"the tuned entry against block_m {args.block_ms}"
        print(key, timings[key], chosen[key], flush=True)
    record = facts | {"configs": chosen, "timings_us": timings}
    if kept.get("note") and keep:  # each entry names its commit; the note says the rest
        record["note"] = kept["note"]
    TUNED_CONFIGS_PATH.write_text(json.dumps(record, indent=1) + "\n")
    print("wrote", TUNED_CONFIGS_PATH)


if __name__ == "__main__":
    main()
