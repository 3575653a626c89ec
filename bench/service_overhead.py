"""Per-step orchestration overhead of the gRPC service pair, inline vs CUDA IPC features.

Starts the target and drafter services as real processes on Qwen3.5-4B-shaped random
checkpoints, runs requests through the gateway's clients and the speculative loop, and
splits every step's wall time into model forward (reported by the services) and
everything else (gRPC, serialization, feature transport, Python). Prints and writes JSON.

    python -m bench.service_overhead --device cuda --out bench/results/overhead.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from dflash_serve.checkpoint.synthetic import DFLASH_4B, QWEN35_4B_TEXT, write_drafter, write_target
from dflash_serve.speculative.loop import SpeculativeGeneration, StopRules
from dflash_serve.speculative.types import SamplingParams
from gateway.drafter_client import DrafterClient
from gateway.target_client import TargetClient
from launcher.service_processes import start_service


class TimedTarget:
    """Wraps a target session; records (wall_ns, forward_ns) per verify."""

    def __init__(self, session):
        self.session, self.verify_times = session, []

    async def prefill(self, prompt_ids):
        return await self.session.prefill(prompt_ids)

    async def verify(self, block_ids):
        began = time.perf_counter_ns()
        step = await self.session.verify(block_ids)
        self.verify_times.append((time.perf_counter_ns() - began, step.forward_ns))
        return step

    async def close(self):
        await self.session.close()


class TimedDrafter:
    def __init__(self, session):
        self.session, self.draft_times = session, []

    async def draft(self, features, anchor_id, num_drafts):
        began = time.perf_counter_ns()
        drafts = await self.session.draft(features, anchor_id, num_drafts)
        self.draft_times.append((time.perf_counter_ns() - began, self.session.last_forward_ns))
        return drafts

    async def close(self):
        await self.session.close()


async def run_requests(target_address, drafter_address, transport, prompt, max_new, count):
    target, drafter = TargetClient(target_address), DrafterClient(drafter_address)
    info = await target.info()
    shared = await target.feature_buffer() if transport == "cuda_ipc" else None
    verify_times, draft_times, outputs = [], [], []
    for _ in range(count):
        t_session = TimedTarget(await target.open(SamplingParams(), transport, timeout_s=600))
        d_session = TimedDrafter(await drafter.open(transport, shared, timeout_s=600))
        run = SpeculativeGeneration(
            t_session, d_session, prompt, StopRules(max_new), 15, info.max_context_tokens
        )
        outputs.append([t async for t in run.tokens()])
        await t_session.close()
        await d_session.close()
        verify_times += t_session.verify_times
        draft_times += d_session.draft_times
    await target.close()
    await drafter.close()
    return summarize(verify_times, draft_times), outputs


def summarize(verify_times, draft_times) -> dict:
    def ms(values):
        return round(statistics.median(values) / 1e6, 3)

    verify_overhead = [wall - forward for wall, forward in verify_times]
    draft_overhead = [wall - forward for wall, forward in draft_times]
    return {
        "num_steps": len(verify_times),
        "verify_wall_ms": ms([w for w, _ in verify_times]),
        "verify_forward_ms": ms([f for _, f in verify_times]),
        "verify_overhead_ms": ms(verify_overhead),
        "draft_wall_ms": ms([w for w, _ in draft_times]),
        "draft_forward_ms": ms([f for _, f in draft_times]),
        "draft_overhead_ms": ms(draft_overhead),
        "step_overhead_ms": ms(
            [v + d for v, d in zip(verify_overhead, draft_overhead, strict=False)]
        ),
    }


def run_facts(device: str) -> dict:
    """Machine, date, commit and command line, recorded with every result."""
    import subprocess
    import sys

    import torch

    gpu = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    commit = (
        subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
        or "unknown"
    )
    return {
        "gpu": gpu,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": commit,
        "command": " ".join(["python -m bench.service_overhead", *sys.argv[1:]]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="dflash-overhead-"))
    began = time.time()
    target_dir = write_target(workdir / "target", QWEN35_4B_TEXT, "bf16", device=args.device)
    drafter_dir = write_drafter(workdir / "drafter", DFLASH_4B, device=args.device)
    print(f"checkpoints written in {time.time() - began:.1f} s", flush=True)
    common = ["--device", args.device, "--max-sessions", "4", "--max-context-tokens", "2048"]
    target = start_service(
        ["target", "--model", str(target_dir), "--drafter-model", str(drafter_dir), *common],
        timeout_s=600,
    )
    drafter = start_service(
        ["drafter", "--model", str(drafter_dir), "--target-model", str(target_dir), *common],
        timeout_s=600,
    )
    prompt = [(i * 7919) % 248000 for i in range(args.prompt_tokens)]
    results = {
        "device": args.device,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "date": time.strftime("%Y-%m-%d"),
    }
    outputs = {}
    try:
        transports = ["inline", "cuda_ipc"] if args.device.startswith("cuda") else ["inline"]
        for transport in transports:
            summary, outputs[transport] = asyncio.run(
                run_requests(
                    target.address,
                    drafter.address,
                    transport,
                    prompt,
                    args.new_tokens,
                    args.requests,
                )
            )
            results[transport] = summary
            print(transport, json.dumps(summary), flush=True)
    finally:
        target.stop()
        drafter.stop()
    results["transports_agree"] = len({json.dumps(o) for o in outputs.values()}) == 1
    print(json.dumps(results, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
