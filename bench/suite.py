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
from bench.report import write_results
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
from dflash_serve.startup_heap import freeze_startup_objects

logger = logging.getLogger("bench")
TAUS = (1, 3, 6, 10)
CHALLENGE = {64: 128, 2048: 256, 8192: 256}
CONCURRENCY = (1, 4, 8, 16)
# --smoke: the same code on the CPU with tiny shapes, to check the suite before GPU time.
SMOKE_TARGET = small_target_config(512, 511)
SMOKE_DRAFTER = small_drafter_config(512, 500, sliding_window=64)


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


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
        try:
            asyncio.run(self._services(target.address, drafter.address))
        finally:
            target.stop()
            drafter.stop()

    async def _services(self, target_address: str, drafter_address: str) -> None:
        from gateway.drafter_client import DrafterClient
        from gateway.target_client import TargetClient

        freeze_startup_objects()  # as the gateway does: no full collection mid-measurement
        target, drafter = TargetClient(target_address), DrafterClient(drafter_address)
        await target.info(), await drafter.info()  # finds the local session sockets
        self.results["sessions_on"] = target.sessions.transport
        shared = await target.feature_buffer() if self.transport == "cuda_ipc" else None
        vocab = self.vocab
        run = measure_e2e.run_request
        prompt = [(i * 7919) % self.vocab for i in range(512)]
        reference = await run(target, None, prompt, self.args.new_tokens)
        self.results["e2e"] = {}
        for tau in TAUS:
            result = await run(
                target,
                drafter,
                prompt,
                self.args.new_tokens,
                reference.tokens,
                tau,
                vocab,
                self.transport,
                shared,
            )
            self.results["e2e"][str(tau)] = measure_e2e.summarize(result, reference.tokens)
            progress(f"  e2e τ={tau}: {self.results['e2e'][str(tau)]}")
            if tau == 6:
                self.results["step_breakdown_ms"] = breakdown(result.times)
        self.results["e2e_grpc"] = await self._over_grpc(target_address, drafter_address, prompt)
        self.results["challenge_ms"] = {}
        for prompt_len, new_tokens in self.challenge.items():
            long_prompt = [(i * 104729) % self.vocab for i in range(prompt_len)]
            oracle = await run(target, None, long_prompt, new_tokens)
            result = await run(
                target,
                drafter,
                long_prompt,
                new_tokens,
                oracle.tokens,
                6,
                vocab,
                self.transport,
                shared,
            )
            self.results["challenge_ms"][str(prompt_len)] = result.total_s * 1e3
            self.results.setdefault("challenge_detail", {})[str(prompt_len)] = (
                measure_e2e.summarize(result, oracle.tokens)
            )
            progress(f"  challenge {prompt_len}: {result.total_s * 1e3:.0f} ms")
        self.results["concurrency"] = {}
        short = prompt[:128]
        oracle = await run(target, None, short, 64)
        for count in self.concurrency:

            async def throughput(count=count) -> dict:
                return await measure_e2e.concurrent_throughput(
                    target, drafter, short, oracle.tokens, 6, vocab, count, 64, self.transport,
                    shared,
                )  # fmt: skip

            # Unmeasured first round: the first batches of a new size may compile kernels
            # (Triton specialises on some shapes), which is start-up cost, not throughput.
            first_round = await throughput()
            before = await target.stats(), await drafter.stats()
            # A round is ~11 steps, so one stall decides it: report the median of several.
            rounds = [await throughput() for _ in range(self.args.concurrency_rounds)]
            after = await target.stats(), await drafter.stats()
            batching = {
                "target": batching_during(before[0], after[0], "verify"),
                "drafter": batching_during(before[1], after[1], "draft"),
            }
            self.results["concurrency"][str(count)] = median_round(rounds) | {
                "rounds_tok_s": [r["tok_s"] for r in rounds],
                "first_round_tok_s": first_round["tok_s"],
                "round_summaries": [round_summary(r) for r in rounds],
                "first_round_summary": round_summary(first_round),
                "batching": batching,
            }
            progress(f"  concurrency {count}: {self.results['concurrency'][str(count)]}")
        self.results["http"] = await self._http_layer(target, target_address, prompt)
        await target.close()
        await drafter.close()

    async def _over_grpc(self, target_address: str, drafter_address: str, prompt) -> dict:
        """τ = 6 with the sessions on gRPC streams instead of the local session sockets."""
        from gateway.drafter_client import DrafterClient
        from gateway.target_client import TargetClient

        target = TargetClient(target_address, session_transport="grpc")
        drafter = DrafterClient(drafter_address, session_transport="grpc")
        shared = await target.feature_buffer() if self.transport == "cuda_ipc" else None
        run = measure_e2e.run_request
        new_tokens = self.args.new_tokens
        reference = await run(target, None, prompt, new_tokens)
        result = await run(
            target, drafter, prompt, new_tokens, reference.tokens, 6, self.vocab,
            self.transport, shared,
        )  # fmt: skip
        summary = measure_e2e.summarize(result, reference.tokens)
        summary["step_breakdown_ms"] = breakdown(result.times)
        progress(f"  e2e τ=6 over gRPC streams: {summary}")
        await target.close()
        await drafter.close()
        return {"6": summary}

    async def _http_layer(self, target, target_address: str, prompt: list[int]) -> dict:
        """Target-only requests through the HTTP gateway vs the same through the gRPC client:
        what the HTTP layer (routes, SSE, detokenizing, stops) adds per token."""
        from launcher.service_processes import GATEWAY_LISTENING, start_service, wait_healthy

        model_dir = self.dirs[self.args.e2e_layout]
        write_numbered_tokenizer(model_dir, self.vocab)
        gateway = start_service(
            ["gateway", "--target-address", target_address, "--tokenizer", str(model_dir)],
            timeout_s=300,
            wait_ready=wait_healthy,
            listening=GATEWAY_LISTENING,
        )
        try:
            new_tokens = self.args.new_tokens
            direct = await measure_e2e.run_request(target, None, prompt, new_tokens)
            http = await asyncio.to_thread(
                measure_e2e.http_stream_request, gateway.base_url, prompt, new_tokens
            )
        finally:
            gateway.stop()
        assert http["completion_tokens"] == len(direct.tokens)
        overhead_s = (http["total_s"] - direct.total_s) / max(len(direct.tokens), 1)
        return {
            "gateway_tok_s": round(http["completion_tokens"] / http["total_s"], 2),
            "direct_tok_s": round(len(direct.tokens) / direct.total_s, 2),
            "gateway_ttft_ms": round(http["ttft_s"] * 1e3, 2),
            "direct_ttft_ms": round(direct.ttft_s * 1e3, 2),
            "http_overhead_ms_per_token": round(overhead_s * 1e3, 3),
        }

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


def write_numbered_tokenizer(model_dir: Path, vocab_size: int) -> None:
    """A tokenizer in which every id of the random model decodes to visible text ("<id>"),
    so that the HTTP stream's first content chunk is its first token (a byte tokenizer
    leaves most of a 248 K vocabulary without text: the first *visible* chunk came late)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from dflash_serve.checkpoint.byte_tokenizer import ALL_SPECIAL_TOKENS, write_tokenizer_files

    names = list(ALL_SPECIAL_TOKENS) + [
        f"<{i}>" for i in range(len(ALL_SPECIAL_TOKENS), vocab_size)
    ]
    tokenizer = Tokenizer(models.WordLevel({name: i for i, name in enumerate(names)}, "<6>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(list(ALL_SPECIAL_TOKENS))
    write_tokenizer_files(tokenizer, model_dir)


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


def median_round(rounds: list[dict]) -> dict:
    """The round with the median throughput (the lower middle one of an even count), whole,
    so that its step times stay those of the round whose tok/s is reported."""
    ranked = sorted(rounds, key=lambda r: r["tok_s"])
    return ranked[(len(ranked) - 1) // 2]


def round_summary(result: dict) -> dict:
    """One concurrency round in a line: where its time went and its slowest steps, so that a
    round far off the others (the report keeps the median round whole, not the outliers) can
    be told apart: a slow open or prefill, one stalled step, or waves that split."""
    return {
        "tok_s": result["tok_s"],
        "mean_open_ms": result["mean_open_ms"],
        "mean_ttft_ms": result["mean_ttft_ms"],
        "mean_decode_ms": result["mean_decode_ms"],
        "max_prefill_wall_ms": result["prefill_ms"]["max_wall"],
        "max_verify_wall_ms": result["verify_ms"]["max_wall"],
        # Without each request's first step, which may wait behind the others' prefills:
        # a stall later in the round shows here, a first-step wait only above.
        "max_verify_wall_after_first_ms": result["verify_ms_after_first"]["max_wall"],
        "max_draft_wall_ms": result["draft_ms"]["max_wall"],
        "split_steps": {kind: len(steps) for kind, steps in result["split_waves"].items()},
        "slowest_steps": result["slowest_steps"],
    }


def batching_during(before: dict, after: dict, step: str) -> dict:
    """A service's batching between two GetStats answers: batches, their mean size, how long
    each waited for companions on average, and how many ran on the event loop."""
    batches = after[f"num_{step}_batches"] - before[f"num_{step}_batches"]
    steps = after[f"num_{step}_steps"] - before[f"num_{step}_steps"]
    waited_us = after[f"{step}_wait_us"] - before[f"{step}_wait_us"]
    inline = after[f"num_inline_{step}_batches"] - before[f"num_inline_{step}_batches"]
    return {
        "batches": batches,
        "mean_batch_size": round(steps / batches, 2) if batches else 0.0,
        "mean_wait_ms": round(waited_us / batches / 1e3, 3) if batches else 0.0,
        "inline_batches": inline,
    }


def breakdown(times: measure_e2e.StepTimes) -> dict:
    """Median-free mean split of one step: target forward, drafter forward, the rest."""
    steps = max(len(times.verify), 1)
    verify_fwd = sum(f for _, f in times.verify) / steps / 1e6
    draft_fwd = sum(f for _, f in times.draft) / steps / 1e6
    wall = (sum(w for w, _ in times.verify) + sum(w for w, _ in times.draft)) / steps / 1e6
    return {
        "target forward": verify_fwd,
        "drafter forward": draft_fwd,
        "orchestration": wall - verify_fwd - draft_fwd,
    }


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
