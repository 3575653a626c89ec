"""The benchmark's gateway role: the speculative loop over the running target and drafter
services, measured in a process of its own.

The gateway holds no CUDA context, does not import torch, and has none of the suite's history
(gigabytes of checkpoint tensors written and freed, its own engines in other sections); the
client that measures the services should not either. `bench.suite` runs
`measure_in_own_process`, which starts `python -m bench.e2e_client PLAN OUT` (a fresh
interpreter: a multiprocessing child would re-import the suite, torch with it);
`--e2e-client suite` keeps the loop in the suite's process, as before 2026-12-07, for
comparison.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from bench import measure_e2e
from bench.report import progress
from dflash_serve import stall_watch
from dflash_serve.startup_heap import freeze_startup_objects
from gateway.drafter_client import DrafterClient
from gateway.target_client import TargetClient
from launcher.service_processes import GATEWAY_LISTENING, start_service, wait_healthy

TAUS = (1, 3, 6, 10)


@dataclass(frozen=True)
class ClientPlan:
    """What the client measures, in plain values (it crosses to the client's process as JSON)."""

    target_address: str
    drafter_address: str
    tokenizer_dir: Path  # the target's checkpoint: the HTTP section writes a tokenizer there
    vocab: int
    transport: str  # the features' transport: "cuda_ipc" on a GPU, "inline" on the CPU
    new_tokens: int
    concurrency_rounds: int
    challenge: dict[int, int] = field(default_factory=dict)  # prompt length → new tokens
    concurrency: tuple[int, ...] = ()


def plan_to_json(plan: ClientPlan) -> str:
    return json.dumps(dataclasses.asdict(plan), default=str)


def plan_from_json(text: str) -> ClientPlan:
    fields = json.loads(text)
    fields["tokenizer_dir"] = Path(fields["tokenizer_dir"])
    fields["challenge"] = {int(k): v for k, v in fields["challenge"].items()}
    fields["concurrency"] = tuple(fields["concurrency"])
    return ClientPlan(**fields)


def measure_in_own_process(plan: ClientPlan) -> dict:
    """Run the client in a process of its own and return what `measure` returned there; a
    client that dies without answering (killed, out of memory) is an error with no results."""
    with tempfile.TemporaryDirectory(prefix="dflash-e2e-client-") as scratch:
        plan_path, out_path = Path(scratch) / "plan.json", Path(scratch) / "measured.json"
        plan_path.write_text(plan_to_json(plan))
        command = [sys.executable, "-m", "bench.e2e_client", str(plan_path), str(out_path)]
        completed = subprocess.run(command, check=False)
        if not out_path.exists():
            return {"results": {}, "error": f"the client exited {completed.returncode}, no results"}
        return json.loads(out_path.read_text())


def measure(plan: ClientPlan) -> dict:
    """{"results": what was measured, "error": the traceback of a failure or None}: a section
    that fails halfway keeps what it measured before, as the suite's other sections do."""
    client = E2EClient(plan)
    error = None
    try:
        asyncio.run(client.run())
    except Exception:  # not KeyboardInterrupt: ^C stops the suite, not just this section
        error = traceback.format_exc()
    # Which process measured, and whether torch was loaded there by the end (the gateway's
    # process never loads it).
    client.results["e2e_client_process"] = {"pid": os.getpid(), "torch": "torch" in sys.modules}
    return {"results": client.results, "error": error}


class E2EClient:
    """The loop through the gateway's gRPC clients, with imposed acceptance (`measure_e2e`)."""

    def __init__(self, plan: ClientPlan) -> None:
        self.plan = plan
        self.results: dict = {}

    async def run(self) -> None:
        target_address, drafter_address = self.plan.target_address, self.plan.drafter_address
        freeze_startup_objects()  # as the gateway does: no full collection mid-measurement
        target, drafter = TargetClient(target_address), DrafterClient(drafter_address)
        await target.info(), await drafter.info()  # finds the local session sockets
        self.results["sessions_on"] = target.sessions.transport
        shared = await target.feature_buffer() if self.plan.transport == "cuda_ipc" else None
        vocab = self.plan.vocab
        run = measure_e2e.run_request
        prompt = [(i * 7919) % vocab for i in range(512)]
        reference = await run(target, None, prompt, self.plan.new_tokens)
        self.results["e2e"] = {}
        for tau in TAUS:
            result = await run(
                target,
                drafter,
                prompt,
                self.plan.new_tokens,
                reference.tokens,
                tau,
                vocab,
                self.plan.transport,
                shared,
            )
            self.results["e2e"][str(tau)] = measure_e2e.summarize(result, reference.tokens)
            progress(f"  e2e τ={tau}: {self.results['e2e'][str(tau)]}")
            if tau == 6:
                self.results["step_breakdown_ms"] = breakdown(result.times)
        self.results["e2e_grpc"] = await self._over_grpc(target_address, drafter_address, prompt)
        self.results["challenge_ms"] = {}
        for prompt_len, new_tokens in self.plan.challenge.items():
            long_prompt = [(i * 104729) % vocab for i in range(prompt_len)]
            oracle = await run(target, None, long_prompt, new_tokens)
            result = await run(
                target,
                drafter,
                long_prompt,
                new_tokens,
                oracle.tokens,
                6,
                vocab,
                self.plan.transport,
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
        for count in self.plan.concurrency:

            async def throughput(count=count) -> dict:
                return await measure_e2e.concurrent_throughput(
                    target, drafter, short, oracle.tokens, 6, vocab, count, 64, self.plan.transport,
                    shared,
                )  # fmt: skip

            # Unmeasured first round: the first batches of a new size may compile kernels
            # (Triton specialises on some shapes), which is start-up cost, not throughput.
            first_round = await throughput()
            before = await target.stats(), await drafter.stats()
            # A round is ~11 steps, so one stall decides it: report the median of several.
            rounds = [await throughput() for _ in range(self.plan.concurrency_rounds)]
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
        target = TargetClient(target_address, session_transport="grpc")
        drafter = DrafterClient(drafter_address, session_transport="grpc")
        shared = await target.feature_buffer() if self.plan.transport == "cuda_ipc" else None
        run = measure_e2e.run_request
        new_tokens = self.plan.new_tokens
        reference = await run(target, None, prompt, new_tokens)
        result = await run(
            target, drafter, prompt, new_tokens, reference.tokens, 6, self.plan.vocab,
            self.plan.transport, shared,
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
        model_dir = self.plan.tokenizer_dir
        write_numbered_tokenizer(model_dir, self.plan.vocab)
        gateway = start_service(
            ["gateway", "--target-address", target_address, "--tokenizer", str(model_dir)],
            timeout_s=300,
            wait_ready=wait_healthy,
            listening=GATEWAY_LISTENING,
        )
        try:
            new_tokens = self.plan.new_tokens
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
    """python -m bench.e2e_client PLAN_JSON OUT_JSON: `measure` the plan, write its answer."""
    plan_path, out_path = map(Path, sys.argv[1:3])
    logging.basicConfig(level=logging.WARNING)  # as bench.suite's process sets itself up
    stall_watch.start_if_enabled()  # DFLASH_STALL_WATCH, inherited from the suite
    measured = measure(plan_from_json(plan_path.read_text()))
    out_path.write_text(json.dumps(measured))


if __name__ == "__main__":
    main()
