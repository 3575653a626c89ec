"""Pick `w4a16_matmul`'s launch config per Qwen3.5-4B 4-bit weight shape by measuring on this
GPU, beside the alternatives: `row_matmul` on the layer's bf16 copy (the default reads) and
torch's tinygemm (`_weight_int4pack_mm`, whose rows are independent too, for scale).

Each candidate is timed as a CUDA graph of 20 calls at 16 rows (one verify block) and 128
rows (8 blocks); each call reads another copy of the weight (copies for 256 MB, four times
the H200's L2), so weights stream from HBM as in a verify step. A shape gets one K split
(the order of a row's sums) and, for each of `ROW_BUCKETS` (up to 16 rows, more), the tile
sizes, warps and stages: of the pairs of launches of one split, the one with the least
t16 + t128 / 4 whose rows are bit-identical across its two launches (128 rows against 16
and 1; a refused pair is counted). Its error against the fp32 product is recorded, and it is
written to
dflash_serve/kernels/w4a16_configs.json with its timings and commit; `--out` records every
kernel's timings. Candidates compile in parallel worker processes first.

    python -m bench.tune_w4a16 [--jobs 16] [--out w4a16.json] [--shapes 18432x2560 ...]
                               [--schedules 4x2,4x3,4x4,8x3]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import multiprocessing
import sys
from collections.abc import Callable

import torch
import triton

from bench.timing import graph_us_per_call, run_facts
from bench.tune_row_matmul import parse_schedules
from dflash_serve.checkpoint.int4_formats import AWQ_GEMM, PackedInt4Weight
from dflash_serve.kernels.row_matmul import row_matmul
from dflash_serve.kernels.w4a16_matmul import (
    BLOCK_MS,
    LAUNCH_FIELDS,
    MIN_TILES_PER_SPLIT,
    ROW_BUCKETS,
    TILE_K,
    TUNED_CONFIGS_PATH,
    PlanarInt4,
    W4A16Config,
    config_key,
    repack_planar,
    row_bucket,
    split_over_programs,
    w4a16_matmul,
    w4a16_reference,
)

# (N, K) of the 4-bit calls a Qwen3.5-4B verify makes with every large linear 4-bit: gate+up,
# down, the GDN input (q, k, v, z) and attention (q, k, v) projections stacked, the mixers'
# output projections.
SHAPES = [(18432, 2560), (2560, 9216), (12288, 2560), (10240, 2560), (2560, 4096)]
GROUP = 128
CALLS_PER_GRAPH = 20
BYTES_ROTATED = 256 * 1024**2
# (warps, stages). Two stages: 41 instead of 66 KB of shared memory a 32-row program, which
# limited the 2026-12-01 winners to 3 programs an SM (ncu, 2026-12-02).
SCHEDULES = ((4, 2), (4, 3), (4, 4), (8, 3))
# Outputs a program. 32 (since 2026-12-05; in that day's H200 sweep never in a shape's top
# 8, bench/results/tune-w4a16-block-n-32-2026-12-05-nvidia-h200.json): twice 64's programs
# at 16 rows, where the 2026-12-02 ncu found 2.1 warps per scheduler waiting on memory with
# nothing else to run, in 9 instead of 17 KB of shared memory at 3 stages (compiled for
# sm_90 here). Triton builds it from mma.sync, not wgmma (which needs 64), so its sums may
# round differently: `choose` takes only a pair of launches whose rows are checked
# independent.
BLOCK_NS = (32, 64, 128)
MAX_SPLIT_COUNT = 12


def candidates(n: int, k: int, schedules=SCHEDULES) -> list[W4A16Config]:
    """Each K split that gives a row tile of `BLOCK_NS` outputs at least 2 or 4 programs per
    SM, and `splits_by_count` (at least two tiles a split), with `BLOCK_NS` outputs
    by 16, 32 or 64 rows a program and every (warps, stages) of `schedules`."""
    num_tiles = triton.cdiv(k, TILE_K)
    splits = {
        split_over_programs(n, k, min_programs, block_n=block_n, block_m=16).tiles_per_split
        for block_n, min_programs in itertools.product(BLOCK_NS, (264, 528))
    }
    splits |= {tiles for tiles in splits_by_count(num_tiles) if tiles >= MIN_TILES_PER_SPLIT}
    grid = itertools.product(sorted(splits), BLOCK_NS, BLOCK_MS, schedules)
    configs = []
    for tiles_per_split, block_n, block_m, (warps, stages) in grid:
        launch = dict(block_n=block_n, block_m=block_m, num_warps=warps, num_stages=stages)
        configs.append(W4A16Config.over_splits(num_tiles, tiles_per_split, **launch))
    return configs


def splits_by_count(num_tiles: int) -> set[int]:
    """Tiles per split for each split count 1 … `MAX_SPLIT_COUNT`: ⌈num_tiles / count⌉.

    The program-count rule above yields only a few splits per shape (the fewest that reach a
    program count), and it skipped faster ones: on an H100 (2026-12-06, tuned launches, split
    sums included) at 16 rows down in 9 splits of 4 tiles took 10.3 against 12.4 µs for its
    8 of 5 (7 × 5 + 1), the GDN input in 2 of 5 11.6 against 12.6 µs for its 3 of 4 (4 + 4 + 2),
    attention's q·k·v in 2 of 5 10.9 against 11.4 µs for its 4 of 3 (3 + 3 + 3 + 1). Why each
    is faster (fewer partial sums, programs better spread) was not measured."""
    return {triton.cdiv(num_tiles, count) for count in range(1, MAX_SPLIT_COUNT + 1)}


def choose(
    results: list[tuple[dict, W4A16Config]],
    rows_independent_pair: Callable[[list[W4A16Config]], bool] = lambda launches: True,
) -> tuple[list[W4A16Config], dict, int]:
    """From (timings, config) of every candidate: the launch per `ROW_BUCKETS` entry, both
    of one K split, their timings (t16 of the first, t128 of the second) and how many faster
    pairs `rows_independent_pair` refused. Pairs are tried by t16 + t128 / 4, least first."""
    by_split: dict[int, list[tuple[dict, W4A16Config]]] = {}
    for times, config in results:
        by_split.setdefault(config.tiles_per_split, []).append((times, config))
    pairs = [
        (t16["us_16_rows"] + t128["us_128_rows"] / 4, t16, for_16, t128, for_more)
        for group in by_split.values()
        for (t16, for_16), (t128, for_more) in itertools.product(group, group)
    ]
    pairs.sort(key=lambda pair: pair[0])
    assert ROW_BUCKETS == (16, None)  # one launch timed at 16 rows, one at 128
    for refused, (_, t16, for_16, t128, for_more) in enumerate(pairs):
        if rows_independent_pair([for_16, for_more]):
            times = {"us_16_rows": t16["us_16_rows"], "us_128_rows": t128["us_128_rows"]}
            return [for_16, for_more], times, refused
    raise RuntimeError("no pair of launches gives rows independent of the row count")


def by_rows(launches: list[W4A16Config]):
    """`w4a16_matmul` with each row count's launch, as `w4a16_config` would pick it."""

    def call(x, weight):
        return w4a16_matmul(x, weight, config=launches[row_bucket(x.shape[0])])

    return call


def tuned_entry(launches: list[W4A16Config]) -> dict:
    """A shape's entry of w4a16_configs.json (`tuned_configs`' format)."""
    first = launches[0]
    buckets = [
        {"max_rows": most} | {name: getattr(launch, name) for name in LAUNCH_FIELDS}
        for most, launch in zip(ROW_BUCKETS, launches, strict=True)
    ]
    return {"tiles_per_split": first.tiles_per_split, "split_k": first.split_k, "by_rows": buckets}


def random_packed(n: int, k: int, device: str = "cuda") -> PackedInt4Weight:
    """AutoAWQ tensors of random bits (timing needs no real weights)."""
    words = lambda *shape: torch.randint(-(2**31), 2**31 - 1, shape, device=device,  # noqa: E731
                                         dtype=torch.int32)  # fmt: skip
    tensors = {
        "qweight": words(k, n // 8),
        "qzeros": words(k // GROUP, n // 8),
        "scales": (torch.rand(k // GROUP, n, device=device) / 64).half(),
    }
    return PackedInt4Weight(AWQ_GEMM, n, k, GROUP, tensors)


def copy_of(weight: PlanarInt4) -> PlanarInt4:
    """Another copy of the weight's tensors (repacked once, cloned on the GPU)."""
    tensors = {name: getattr(weight, name).clone() for name in ("words", "scales", "zeros")}
    return dataclasses.replace(weight, **tensors)


def copies_for(num_bytes: int) -> int:
    return max(2, min(64, triton.cdiv(BYTES_ROTATED, num_bytes)))


def compile_job(job) -> int:
    """Worker: run every candidate of one shape once (compiles into the disk cache)."""
    n, k, configs = job
    weight = repack_planar(random_packed(n, k))
    x = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
    for config in configs:
        w4a16_matmul(x, weight, config=config)
    torch.cuda.synchronize()
    return len(configs)


def graph_us(call, copies: list, rows: torch.Tensor) -> float:
    """Median µs per call of `call(rows, weight)`, each call reading the next weight copy."""
    return graph_us_per_call(lambda index: call(rows, copies[index % len(copies)]),
                             CALLS_PER_GRAPH)  # fmt: skip


def timed(call, copies: list, rows: dict) -> dict:
    return {f"us_{m}_rows": graph_us(call, copies, x) for m, x in rows.items()}


def tinygemm_copies(packed: PackedInt4Weight, num: int) -> list | str:
    """torch's tinygemm operands (same bytes per weight; values need not match), or why not."""
    n, k = packed.out_features, packed.in_features
    try:
        nibbles = torch.randint(0, 256, (n, k // 2), device="cuda", dtype=torch.uint8)
        weight = torch.ops.aten._convert_weight_to_int4pack(nibbles, 8)
        scales_zeros = torch.rand(k // GROUP, n, 2, device="cuda").bfloat16()
        return [(weight.clone(), scales_zeros.clone()) for _ in range(num)]
    except (RuntimeError, AttributeError) as error:
        return f"{type(error).__name__}: {error}"[:300]


def tinygemm(x: torch.Tensor, operands) -> torch.Tensor:
    return torch.ops.aten._weight_int4pack_mm(x, operands[0], GROUP, operands[1])


def rows_independent(call, weight, x: torch.Tensor) -> bool:
    """Rows of a 128-row call against 16-row and 1-row calls, bit for bit."""
    y128 = call(x, weight)
    same = torch.equal(call(x[:16], weight), y128[:16])
    return same and all(torch.equal(call(x[r : r + 1], weight)[0], y128[r]) for r in (0, 77))


def check(weight: PlanarInt4, launches: list[W4A16Config]) -> dict:
    """The winners against the fp32 product, and 128 rows (the second launch) against 16
    and 1 (the first), bit for bit."""
    x = torch.randn(128, weight.in_features, device="cuda", dtype=torch.bfloat16)
    call = by_rows(launches)
    reference = w4a16_reference(x, weight)
    error = (call(x, weight).float() - reference).abs().max().item()
    return {"max_error_over_max_ref": error / reference.abs().max().item(),
            "rows_independent": rows_independent(call, weight, x)}  # fmt: skip


def baselines(n: int, k: int, packed: PackedInt4Weight, rows: dict) -> dict:
    dense = packed.dequantize(torch.bfloat16)
    results = {}
    dense_copies = [dense.clone() for _ in range(copies_for(dense.nbytes))]
    results["row_matmul_bf16_copy"] = timed(row_matmul, dense_copies, rows)
    del dense_copies
    operands = tinygemm_copies(packed, copies_for(n * k // 2))
    if isinstance(operands, str):
        results["tinygemm"] = {"error": operands}
    else:
        results["tinygemm"] = timed(tinygemm, operands, rows)
        results["tinygemm"]["rows_independent"] = rows_independent(tinygemm, operands[0],
                                                                   rows[128])  # fmt: skip
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=16)
    parser.add_argument("--out", help="also write every kernel's timings here (JSON)")
    parser.add_argument("--shapes", nargs="*", help="NxK items; default: the 4B verify's")
    parser.add_argument(
        "--schedules",
        default=",".join(f"{w}x{s}" for w, s in SCHEDULES),
        help="WARPSxSTAGES items, comma-separated (default: %(default)s)",
    )
    args = parser.parse_args()
    shapes = SHAPES
    if args.shapes:
        shapes = [tuple(int(size) for size in item.split("x")) for item in args.shapes]
    try:
        schedules = parse_schedules(args.schedules)
    except ValueError as error:
        parser.error(str(error))
    facts = run_facts("python -m bench.tune_w4a16 " + " ".join(sys.argv[1:]))
    todo = [(n, k, candidates(n, k, schedules)) for n, k in shapes]
    context = multiprocessing.get_context("spawn")
    with context.Pool(args.jobs) as pool:
        print("compiled", sum(pool.map(compile_job, todo)), "candidates", flush=True)
    kept = json.loads(TUNED_CONFIGS_PATH.read_text()) if TUNED_CONFIGS_PATH.exists() else {}
    chosen, timings = dict(kept.get("configs", {})), dict(kept.get("timings_us", {}))
    record = {}
    for n, k, configs in todo:
        packed = random_packed(n, k)
        rows = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in (16, 128)}
        weight = repack_planar(packed)
        copies = [copy_of(weight) for _ in range(copies_for(n * k // 2))]
        results = []
        for config in configs:
            call = lambda x, w, c=config: w4a16_matmul(x, w, config=c)  # noqa: E731
            results.append((timed(call, copies, rows), config))
        exact = lambda launches, w=weight: check(w, launches)["rows_independent"]  # noqa: E731
        launches, best_times, refused = choose(results, exact)
        key = config_key(n, k, GROUP)
        chosen[key] = tuned_entry(launches)
        gbps = n * k // 2 / best_times["us_16_rows"] / 1e3
        timings[key] = {"commit": facts["commit"], **best_times, "gbps_16_rows": gbps,
                        "candidates": len(results)}  # fmt: skip
        del copies
        results.sort(key=lambda result: result[0]["us_16_rows"] + result[0]["us_128_rows"] / 4)
        record[key] = {
            "best": chosen[key] | best_times | {"gbps_16_rows": gbps},
            "check": check(weight, launches) | {"faster_pairs_refused": refused},
            "top": [dataclasses.asdict(c) | t for t, c in results[:8]],
            "baselines": baselines(n, k, packed, rows),
        }
        print(key, json.dumps(record[key]["best"]), json.dumps(record[key]["check"]),
              json.dumps(record[key]["baselines"]), flush=True)  # fmt: skip
    TUNED_CONFIGS_PATH.write_text(
        json.dumps(facts | {"configs": chosen, "timings_us": timings}, indent=1) + "\n"
    )
    print("wrote", TUNED_CONFIGS_PATH)
    if args.out:
        with open(args.out, "w") as file:
            json.dump(facts | {"shapes": record}, file, indent=1)


if __name__ == "__main__":
    main()
