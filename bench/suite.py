"""The benchmark suite: floor, peers and the whole pipeline, measured in one GPU run.

    python -m bench.suite --out-dir bench/results [--quick]

Builds Qwen3.5-4B-shaped random checkpoints (bf16, int4 MLPs like QuantTrio, int4 on every
large linear) and a drafter of the published DFlash shape, then measures what
bench/README.md lists. Each section that fails is recorded under "errors" and the run goes
on. Nothing here is asserted: numbers are reported as measured.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import shlex
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

from bench import measure_e2e, measure_engine
from bench.e2e_client import TAUS, ClientPlan, measure, measure_in_own_process
from bench.report import progress, write_results
from bench.timing import empty_cache, hbm_bandwidth_gbps, run_facts
from dflash_serve import stall_watch
from dflash_serve.checkpoint.synthetic import (
    DFLASH_4B,
    LAYOUTS,
    QWEN35_4B_TEXT,
    small_drafter_config,
    small_target_config,
    write_drafter,
    write_target,
)
from dflash_serve.layers.int4_reads import INT4_READS

logger = logging.getLogger("bench")
CHALLENGE = {64: 128, 2048: 256, 8192: 256}
CONCURRENCY = (1, 4, 8, 16)
# --smoke: the same code on the CPU with tiny shapes, to check the suite before GPU time.
SMOKE_TARGET = small_target_config(512, 511)
SMOKE_DRAFTER = small_drafter_config(512, 500, sliding_window=64)


class Suite:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.results: dict = run_facts("python -m bench.suite " + " ".join(sys.argv[1:]))
        if args.merge_into:
            earlier = json.loads(args.merge_into.read_text())
            facts = self.results  # this run's machine, date and command replace the old ones
            self.results = earlier | facts | {"command": facts["command"] + " (merged)"}
        if args.commit:
            self.results["commit"] = args.commit
        self.results.setdefault("errors", {})
        self.workdir = Path(tempfile.mkdtemp(prefix="dflash-bench-"))
        self.dirs: dict[str, Path] = {}
        self.device = "cpu" if args.smoke else "cuda"
        self.target_config = SMOKE_TARGET if args.smoke else QWEN35_4B_TEXT
        self.drafter_config = SMOKE_DRAFTER if args.smoke else DFLASH_4B
        self.challenge = {64: 16, 256: 16} if args.smoke else CHALLENGE
        self.concurrency = (1, 2) if args.smoke else CONCURRENCY
        self.transport = "inline" if args.smoke else "cuda_ipc"
        self.vocab = self.target_config["vocab_size"]

    def section(self, name: str, fn) -> None:
        progress(f"{name} …")
        began = time.time()
        self.results["errors"].pop(name, None)  # a section run again replaces its old error
        try:
            fn()
        except Exception as error:  # one failed section must not lose the others
            self.results["errors"][name] = f"{type(error).__name__}: {error}"
            traceback.print_exc()
        progress(f"{name} done in {time.time() - began:.0f} s")
        write_results(self.results, self.args.out_dir)  # partial results survive a timeout
        gc.collect()
        empty_cache()

    def checkpoints(self) -> None:
        for layout in self.args.layouts:
            self.dirs[layout] = write_target(
                self.workdir / layout, self.target_config, layout, device=self.device
            )
        self.dirs["drafter"] = write_drafter(
            self.workdir / "drafter", self.drafter_config, device=self.device
        )

    def layouts(self) -> None:

        self.results["hbm_gbps"] = hbm_bandwidth_gbps(self.device)
        self.results["layouts_commit_graphs"] = self.args.commit_graphs
        drafter = measure_engine.build_drafter(
            self.dirs["drafter"], self.dirs["bf16"], 2, 4096, self.device
        )
        draft_ms = measure_engine.draft_step_ms(drafter)
        del drafter
        self.results["layouts"] = {}
        for layout in self.args.layouts:
            weight_bytes = measure_engine.weight_bytes_per_forward(self.dirs[layout])
            engine = measure_engine.build_target(  # 4-bit layers: their bf16 copy, then packed
                self.dirs[layout],
                2,
                4096,
                self.device,
                int4_reads="bf16",
                commit_graphs=self.args.commit_graphs,
            )
            self.results["layouts"][layout] = {
                "weight_bytes": weight_bytes,
                "floor_ms": weight_bytes / (self.results["hbm_gbps"] * 1e9) * 1e3,
                "verify_ms": measure_engine.verify_step_ms(engine),
                "draft_ms": draft_ms,
            }
            if layout != "bf16":  # the W4A16 kernel (the services' default reads)
                del engine
                gc.collect()
                empty_cache()
                engine = measure_engine.build_target(
                    self.dirs[layout],
                    2,
                    4096,
                    self.device,
                    int4_reads="int4",
                    commit_graphs=self.args.commit_graphs,
                )
                verify_ms = measure_engine.verify_step_ms(engine)
                self.results["layouts"][layout]["verify_ms_int4_reads"] = verify_ms
            progress(f"  {layout}: {self.results['layouts'][layout]}")
            if layout == "bf16":
                self.engine_checks(engine)
            del engine
            gc.collect()
            empty_cache()

    def engine_checks(self, engine) -> None:
        self.results.setdefault("ar_tok_s", {})["ours"] = measure_engine.ours_decode_tok_s(engine)
        self.results["state_bytes_per_seq"] = measure_engine.state_bytes(engine)
        self.results["spec_equals_ar"] = {
            "batch1": measure_engine.spec_equals_ar(engine, None, 1),
            "batch8": measure_engine.spec_equals_ar(
                measure_engine.build_target(
                    self.dirs["bf16"], 8, 512, self.device, commit_graphs=self.args.commit_graphs
                ),
                None,
                8,
            ),
        }

    def transformers_peer(self) -> None:
        peer = measure_engine.transformers_decode_tok_s(self.dirs["bf16"], self.device)
        self.results.setdefault("ar_tok_s", {})["transformers"] = peer["tok_s"]
        self.results["ar_tok_s"]["fla_installed"] = peer["fla_installed"]

    def end_to_end(self) -> None:
        from launcher.service_processes import start_service

        layout = self.args.e2e_layout
        self.results["e2e_int4_reads"] = self.args.e2e_int4_reads
        self.results["e2e_commit_graphs"] = self.args.commit_graphs
        self.results["e2e_service_flags"] = {
            "target": self.args.target_flags,
            "drafter": self.args.drafter_flags,
        }
        common = ["--device", self.device, "--max-sessions", "16", "--max-context-tokens", "8704"]
        target = start_service(
            [
                "target",
                "--model",
                str(self.dirs[layout]),
                "--drafter-model",
                str(self.dirs["drafter"]),
                "--int4-reads",
                self.args.e2e_int4_reads,
                "--commit-graphs" if self.args.commit_graphs else "--no-commit-graphs",
                *common,
                *shlex.split(self.args.target_flags),
            ]
        )
        drafter = start_service(
            [
                "drafter",
                "--model",
                str(self.dirs["drafter"]),
                "--target-model",
                str(self.dirs[layout]),
                *common,
                *shlex.split(self.args.drafter_flags),
            ]
        )
        plan = ClientPlan(
            target_address=target.address,
            drafter_address=drafter.address,
            tokenizer_dir=self.dirs[layout],
            vocab=self.vocab,
            transport=self.transport,
            new_tokens=self.args.new_tokens,
            concurrency_rounds=self.args.concurrency_rounds,
            challenge=self.challenge,
            concurrency=self.concurrency,
        )
        self.results["e2e_client"] = self.args.e2e_client
        try:
            if self.args.e2e_client == "process":
                measured = measure_in_own_process(plan)
            else:
                measured = measure(plan)
        finally:
            target.stop()
            drafter.stop()
        self.results |= measured["results"]
        if measured["error"]:
            raise RuntimeError(f"the e2e client failed:\n{measured['error']}")

    def in_process(self) -> None:
        """The same loop and imposed acceptance without gRPC, for the overhead comparison."""
        from drafter_service.session import InProcessDrafter
        from target_service.session import InProcessTarget

        layout = self.args.e2e_layout
        taps = tuple(self.drafter_config["dflash_config"]["target_layer_ids"])
        engine = measure_engine.build_target(
            self.dirs[layout],
            2,
            2048,
            self.device,
            taps,
            int4_reads=self.args.e2e_int4_reads,
            commit_graphs=self.args.commit_graphs,
        )
        drafter_engine = measure_engine.build_drafter(
            self.dirs["drafter"], self.dirs[layout], 2, 2048, self.device
        )
        target = LocalTarget(InProcessTarget(engine))
        drafter = LocalDrafter(InProcessDrafter(drafter_engine))
        prompt = [(i * 7919) % self.vocab for i in range(512)]
        vocab = self.vocab

        async def go():
            reference = await measure_e2e.run_request(target, None, prompt, self.args.new_tokens)
            out = {}
            for tau in TAUS:
                result = await measure_e2e.run_request(
                    target, drafter, prompt, self.args.new_tokens, reference.tokens, tau, vocab
                )
                out[str(tau)] = measure_e2e.summarize(result, reference.tokens)
            return out

        self.results["in_process"] = asyncio.run(go())
        target.inner.close()
        drafter.inner.close()


class LocalTarget:
    """In-process target with the remote client's open() signature."""

    def __init__(self, inner) -> None:
        self.inner = inner

    async def info(self):
        from types import SimpleNamespace

        return SimpleNamespace(max_context_tokens=self.inner.engine.state.shape.max_len)

    async def open(self, sampling, transport="none", timeout_s=None):
        return await self.inner.open(sampling)


class LocalDrafter:
    def __init__(self, inner) -> None:
        self.inner = inner

    async def open(self, transport="inline", shared=None, timeout_s=None):
        return await self.inner.open()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    parser.add_argument("--e2e-layout", default="int4_mlp", choices=LAYOUTS)
    parser.add_argument(
        "--e2e-int4-reads",
        default=INT4_READS[0],
        choices=INT4_READS,
        help="what the target's GPU kernels read for 4-bit layers in the e2e and in_process "
        "sections (default: the service's, %(default)s)",
    )
    parser.add_argument(
        "--commit-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the target service's --[no-]commit-graphs, for every target the suite builds",
    )
    parser.add_argument(
        "--target-flags",
        default="",
        help="more flags for the e2e section's target service (an A/B of a service setting), "
        'e.g. "--max-wait-us 10000"; recorded in the results',
    )
    parser.add_argument(
        "--drafter-flags", default="", help="likewise for the e2e section's drafter service"
    )
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument(
        "--e2e-client",
        default="process",
        choices=("process", "suite"),
        help="where the e2e sections' client (the gateway's role) runs: a process of its own "
        "that, like the gateway, holds no CUDA context (default), or this suite process, as "
        "before 2026-12-07 (for comparison)",
    )
    parser.add_argument(
        "--concurrency-rounds",
        type=int,
        default=3,
        help="measured rounds per stream count (after one unmeasured); the median is reported",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument(
        "--keep-checkpoints",
        action="store_true",
        help="keep the random checkpoints (a temporary directory) after the run",
    )
    parser.add_argument("--commit", help="commit id to record (default: git rev-parse)")
    parser.add_argument(
        "--merge-into",
        type=Path,
        help="add this run's sections to an earlier run's JSON (runs split "
        "across several GPU commands)",
    )
    parser.add_argument(
        "--skip",
        nargs="*",
        default=[],
        help="sections to skip: layouts transformers e2e in_process",
    )
    args = parser.parse_args()
    if args.concurrency_rounds < 1:
        parser.error(
            f"--concurrency-rounds {args.concurrency_rounds}: at least 1 round is measured"
        )
    if args.smoke:
        args.new_tokens = min(args.new_tokens, 16)
    if "bf16" not in args.layouts:
        args.layouts.insert(0, "bf16")
    logging.basicConfig(level=logging.WARNING)
    stall_watch.start_if_enabled()  # DFLASH_STALL_WATCH: this process and the services
    suite = Suite(args)
    try:
        suite.section("checkpoints", suite.checkpoints)
        for name, fn in (
            ("layouts", suite.layouts),
            ("transformers", suite.transformers_peer),
            ("e2e", suite.end_to_end),
            ("in_process", suite.in_process),
        ):
            if name not in args.skip:
                suite.section(name, fn)
    finally:  # 4B checkpoints of several GB each: runs left behind filled a GPU machine's disk
        if args.keep_checkpoints:
            progress(f"checkpoints kept in {suite.workdir}")
        else:
            shutil.rmtree(suite.workdir, ignore_errors=True)
    for path in write_results(suite.results, args.out_dir):
        progress(f"wrote {path}")


if __name__ == "__main__":
    main()
