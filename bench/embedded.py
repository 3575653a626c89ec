"""Acceptance and speed of a target + DFlash drafter pair on real prompts, in this process.

    python -m bench.embedded [--target DIR --drafter DIR] [--prompts FILE.json]
        [--device cpu|cuda] [--max-new-tokens 128] [--num-prompts N]
        [--out bench/results/embedded.json] [--corpus-note TEXT] [--commit ID]

Without --target/--drafter it measures the embedded default pair (`dflash-serve up` with no
model) on its held-out prompts (launcher/embedded_pair/held_out_prompts.json). Both
engines are built as their services build them (TargetRuntime, DrafterRuntime: the
services' dtype, state shape and batchers) and driven by the gateway's loop
(SpeculativeGeneration, the gateway's default of 15 drafts and its draft pacing, the
target's EOS ids as stops); only gRPC and HTTP are left out. Per prompt: target-only
greedy decoding, speculative greedy decoding, and speculative decoding at temperature 0.7
with a fixed seed.

τ and the per-position acceptance are counted over verify steps that carried drafts (the
loop's SpecStats, vLLM's definition), so the step that only commits the last token of a
request does not count. Acceptance is a prefix (draft k is accepted only if drafts 1..k-1
were), hence τ = 1 + Σ_k accept_per_position[k] exactly.

The results file is merged: keys of this run replace those in the existing file, so a CPU
run and a GPU run each add their own `speedup_<device>` and tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.report import progress
from bench.timing import run_facts, synchronize
from dflash_serve.service_settings import ServiceSettings
from dflash_serve.speculative.loop import SpeculativeGeneration, StopRules
from dflash_serve.speculative.pacing import DraftPacing, StepCosts
from dflash_serve.speculative.types import SamplingParams, SpecStats
from drafter_service.config import DrafterServiceConfig
from drafter_service.model.config import load_dflash_config
from drafter_service.runtime import DrafterRuntime
from gateway.config import GatewayConfig
from target_service.config import TargetServiceConfig
from target_service.runtime import TargetRuntime

NUM_DRAFTS = GatewayConfig.num_drafts  # the gateway's default --num-drafts
SAMPLED_TEMPERATURE = 0.7
SAMPLED_SEED = 1234
DEFAULT_QUESTIONS = (
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 100.",
)


@dataclass
class Decode:
    """One request's output, its wall time (open to last token) and the loop's counters."""

    token_ids: list[int]
    wall_s: float
    stats: SpecStats


class PairInProcess:
    """The target and drafter, built as their services build them, and one request's run."""

    def __init__(
        self,
        target_dir: Path,
        drafter_dir: Path,
        device: str,
        max_context_tokens: int,
        is_adaptive: bool = True,
    ) -> None:
        """is_adaptive: pace drafting as the gateway does by default (DraftPacing)."""
        self.is_adaptive = is_adaptive
        self.step_costs = StepCosts()  # shared by every request, as in one gateway
        settings = ServiceSettings(device=device, max_context_tokens=max_context_tokens)
        taps = load_dflash_config(drafter_dir).target_layer_ids
        target_dtype, drafter_dtype = settings.resolved_dtype, settings.drafter_dtype
        self.dtype = (
            target_dtype
            if target_dtype == drafter_dtype
            else f"target {target_dtype}, drafter {drafter_dtype}"
        )
        self.target = TargetRuntime(
            TargetServiceConfig(str(target_dir), tuple(taps), service=settings)
        )
        self.drafter = DrafterRuntime(
            DrafterServiceConfig(str(drafter_dir), str(target_dir), settings)
        )
        self.num_drafts = min(NUM_DRAFTS, self.drafter.info.max_drafts)
        self.stop_token_ids = frozenset(self.target.info.eos_token_ids)

    async def decode(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        sampling: SamplingParams,
        is_speculative: bool,
    ) -> Decode:
        began = time.perf_counter()
        target = await self.target.target.open(sampling)
        drafter = await self.drafter.drafter.open() if is_speculative else None
        run = SpeculativeGeneration(
            target,
            drafter,
            prompt_ids,
            StopRules(max_new_tokens, self.stop_token_ids),
            self.num_drafts,
            self.target.info.max_context_tokens,
            DraftPacing(self.step_costs) if self.is_adaptive else None,
        )
        try:
            token_ids = [token async for token in run.tokens()]
            synchronize()
            wall_s = time.perf_counter() - began
        finally:
            await target.close()
            if drafter is not None:
                await drafter.close()
        if run.drafter_error is not None:  # the loop fell back to target-only: not a measurement
            raise RuntimeError(f"the drafter failed: {run.drafter_error}") from run.drafter_error
        return Decode(token_ids, wall_s, run.stats)

    def close(self) -> None:
        self.target.close()
        self.drafter.close()


def pooled_acceptance(stats: Sequence[SpecStats], num_positions: int) -> tuple[float, list[float]]:
    """(τ, fraction of drafted steps in which draft position k was accepted, k < num_positions)
    over the steps that carried drafts in all of `stats`; (1.0, zeros) with no such step."""
    num_steps = sum(s.num_drafts for s in stats)
    counts = [0] * num_positions
    for s in stats:
        assert len(s.accepted_per_position) <= num_positions, s.accepted_per_position
        for position, count in enumerate(s.accepted_per_position):
            counts[position] += count
    if num_steps == 0:
        return 1.0, [0.0] * num_positions
    num_accepted = sum(s.num_accepted_tokens for s in stats)
    assert num_accepted == sum(counts), "acceptance is a prefix of the drafts"
    return 1.0 + num_accepted / num_steps, [count / num_steps for count in counts]


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (a length difference counts), None if equal."""
    if a == b:
        return None
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def load_prompts(path: Path | None, tokenizer) -> list[str]:
    """Chat-form prompt strings: a JSON list from `path`, or the built-in questions put in the
    target's chat template (thinking off)."""
    if path is None:
        return [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": question}],
                tokenize=False,
                add_generation_prompt=True,
                enable_thinking=False,
            )
            for question in DEFAULT_QUESTIONS
        ]
    prompts = json.loads(path.read_text())
    if not (
        isinstance(prompts, list) and prompts and all(isinstance(p, str) and p for p in prompts)
    ):
        raise ValueError(f"--prompts {path}: expected a non-empty JSON list of non-empty strings")
    return prompts


def describe_device(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    model = platform.processor() or "unknown CPU"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        lines = cpuinfo.read_text().splitlines()
        model = next(
            (line.split(":", 1)[1].strip() for line in lines if "model name" in line), model
        )
    return f"{model}, {os.cpu_count()} cores ({torch.get_num_threads()} torch threads)"


async def measure(
    pair: PairInProcess, prompts_ids: list[list[int]], max_new: int, device_key: str
) -> dict:
    """Every prompt target-only, speculative greedy and speculative sampled; the pooled figures
    (speed under keys ending in `_<device_key>`)."""
    greedy = SamplingParams()
    sampled = SamplingParams(temperature=SAMPLED_TEMPERATURE, seed=SAMPLED_SEED)
    # Warm-up, untimed: every block length (one request both ways), then every prompt's
    # prefill (a one-token request each). On a fresh GPU machine prefills of some lengths
    # compiled kernels inside the timed target-only decodes (0.35-0.48 s instead of 0.08 for
    # a 569-token prompt; 984-1,071 tok/s target-only instead of 1,400-1,700 in later runs);
    # warming up on the longest prompt alone did not cover them.
    for is_speculative in (False, True):
        await pair.decode(prompts_ids[0], max_new, greedy, is_speculative)
    for prompt_ids in prompts_ids:
        await pair.decode(prompt_ids, 1, greedy, False)
    plain_s = spec_s = 0.0
    num_plain = num_spec = 0
    greedy_stats, sampled_stats, differences = [], [], {}
    for index, prompt_ids in enumerate(prompts_ids):
        plain = await pair.decode(prompt_ids, max_new, greedy, False)
        spec = await pair.decode(prompt_ids, max_new, greedy, True)
        spec_sampled = await pair.decode(prompt_ids, max_new, sampled, True)
        plain_s, spec_s = plain_s + plain.wall_s, spec_s + spec.wall_s
        num_plain, num_spec = num_plain + len(plain.token_ids), num_spec + len(spec.token_ids)
        greedy_stats.append(spec.stats)
        sampled_stats.append(spec_sampled.stats)
        difference = first_difference(spec.token_ids, plain.token_ids)
        if difference is not None:
            differences[str(index)] = difference
        progress(
            f"prompt {index} ({len(prompt_ids)} tokens): target-only {len(plain.token_ids)} "
            f"tokens in {plain.wall_s:.2f} s; speculative {len(spec.token_ids)} tokens in "
            f"{spec.wall_s:.2f} s, τ {spec.stats.mean_acceptance_length:.2f} over "
            f"{spec.stats.num_drafts} steps; τ@{SAMPLED_TEMPERATURE} "
            f"{spec_sampled.stats.mean_acceptance_length:.2f}; "
            f"{'identical' if difference is None else f'differs at token {difference}'}"
        )
    tau_greedy, accept_per_position = pooled_acceptance(greedy_stats, NUM_DRAFTS)
    tau_sampled, accept_per_position_sampled = pooled_acceptance(sampled_stats, NUM_DRAFTS)
    return {
        "tau_greedy": tau_greedy,
        "tau_t07": tau_sampled,
        "accept_per_position": accept_per_position,
        "accept_per_position_t07": accept_per_position_sampled,
        "identical_to_target_only": not differences,
        "first_difference": differences,
        f"speedup_{device_key}": plain_s / spec_s,
        f"target_only_tok_s_{device_key}": num_plain / plain_s,
        f"speculative_tok_s_{device_key}": num_spec / spec_s,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.embedded", description=__doc__)
    parser.add_argument("--target", type=Path, help="target checkpoint dir (with its tokenizer)")
    parser.add_argument("--drafter", type=Path, help="DFlash drafter checkpoint dir")
    parser.add_argument("--prompts", type=Path, help="JSON list of chat-form prompt strings")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, help="use the first N prompts (default: all)")
    parser.add_argument("--max-context-tokens", type=int, default=4096, help="tokens per session")
    parser.add_argument("--out", type=Path, default=Path("bench/results/embedded.json"))
    parser.add_argument("--corpus-note", help="what the pair was trained on (kept if omitted)")
    parser.add_argument("--commit", help="commit id to record (default: git rev-parse)")
    parser.add_argument(
        "--no-adaptive-drafting",
        dest="adaptive_drafting",
        action="store_false",
        help="draft at every step (the gateway paces drafting by default)",
    )
    args = parser.parse_args(argv)
    if (args.target is None) != (args.drafter is None):
        parser.error("give both --target and --drafter, or neither (the embedded pair)")
    for name in ("max_new_tokens", "num_prompts"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.target is None:
        from launcher.embedded_default import EMBEDDED_DIR, embedded_model_pair

        args.target, args.drafter = embedded_model_pair()
        if args.prompts is None:  # its held-out prompts, never seen in training
            args.prompts = EMBEDDED_DIR / "held_out_prompts.json"
    return args


def main(argv: list[str] | None = None) -> dict:
    """Run the measurement, merge it into --out and return the merged results."""
    from transformers import AutoTokenizer

    args = parse_args(argv)
    command = "python -m bench.embedded " + " ".join(sys.argv[1:] if argv is None else argv)
    facts = run_facts(command)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    prompts = load_prompts(args.prompts, tokenizer)[: args.num_prompts]
    prompts_ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    pair = PairInProcess(
        args.target, args.drafter, args.device, args.max_context_tokens, args.adaptive_drafting
    )
    prompt_source = str(args.prompts) if args.prompts else "built-in questions"
    progress(
        f"{len(prompts)} prompts from {prompt_source}, {args.max_new_tokens} new tokens, "
        f"{args.device} ({pair.dtype})"
    )
    key = "gpu" if args.device == "cuda" else "cpu"
    try:
        run = asyncio.run(measure(pair, prompts_ids, args.max_new_tokens, key))
    finally:
        pair.close()
    run |= {
        f"device_{key}": f"{describe_device(args.device)}, {pair.dtype}",
        "date": facts["date"],
        "commit": args.commit or facts["commit"],
        "command": command,
        "torch": facts["torch"],
        "target": str(args.target),
        "drafter": str(args.drafter),
        "prompts": prompt_source,
        "num_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "adaptive_drafting": args.adaptive_drafting,
    }
    if args.corpus_note is not None:
        run["corpus"] = args.corpus_note
    results = json.loads(args.out.read_text()) if args.out.is_file() else {}
    results |= run
    results.setdefault("corpus", None)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    progress(
        f"τ greedy {run['tau_greedy']:.3f}, τ@{SAMPLED_TEMPERATURE} {run['tau_t07']:.3f}; "
        f"speedup {run[f'speedup_{key}']:.2f}× ({run[f'target_only_tok_s_{key}']:.1f} → "
        f"{run[f'speculative_tok_s_{key}']:.1f} tok/s); identical to target-only: "
        f"{run['identical_to_target_only']}; wrote {args.out}"
    )
    return results


if __name__ == "__main__":
    main()
