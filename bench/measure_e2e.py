"""End-to-end measurements over the two gRPC services (real processes) with acceptance imposed.

The drafter service still runs its forward for every step (and costs its time); only the
tokens it returns are replaced by the target's known continuation with a chosen number of
correct drafts, so that speed at an acceptance length τ is measured honestly. The loop runs
in this process through the gateway's gRPC clients; the HTTP layer is not in these numbers.
"""

from __future__ import annotations

import asyncio
import collections
import statistics
import time
from dataclasses import dataclass, field

from dflash_serve import step_trace
from dflash_serve.speculative.loop import SpeculativeGeneration, StopRules
from dflash_serve.speculative.pending_drafter import PendingDrafterSession
from dflash_serve.speculative.scripted_drafter import ScriptedDrafter
from dflash_serve.speculative.types import SamplingParams


@dataclass
class StepTimes:
    """Per-step (wall_ns, forward_ns) of verify and draft calls, and of the prefill; and
    the size of the batch each step's forward ran in (`batch_sizes[kind]`, in step order)."""

    verify: list[tuple[int, int]] = field(default_factory=list)
    draft: list[tuple[int, int]] = field(default_factory=list)
    prefill: list[tuple[int, int]] = field(default_factory=list)
    batch_sizes: dict[str, list[int]] = field(
        default_factory=lambda: {"prefill": [], "verify": [], "draft": []}
    )


class TimedTarget:
    def __init__(self, session, times: StepTimes) -> None:
        self.session, self.times = session, times

    async def prefill(self, prompt_ids):
        began = time.perf_counter_ns()
        step = await self.session.prefill(prompt_ids)
        self.times.prefill.append((time.perf_counter_ns() - began, step.forward_ns))
        self.times.batch_sizes["prefill"].append(step.batch_size)
        return step

    async def verify(self, block_ids):
        began = time.perf_counter_ns()
        step = await self.session.verify(block_ids)
        self.times.verify.append((time.perf_counter_ns() - began, step.forward_ns))
        self.times.batch_sizes["verify"].append(step.batch_size)
        return step

    async def close(self):
        await self.session.close()


class ImposedAcceptanceDrafter:
    """Runs the real drafter (timed), then returns scripted drafts with τ−1 correct ones.
    `real`: a PendingDrafterSession, as the gateway opens it."""

    def __init__(
        self, real: PendingDrafterSession, continuation, tau: int, vocab: int, times: StepTimes
    ) -> None:
        self.real = real
        self.script = ScriptedDrafter(continuation, [tau - 1], vocab)
        self.times = times

    async def draft(self, features, anchor_id, num_drafts):
        real = await self.real.session()  # (its open overlapped the prefill; not timed)
        began = time.perf_counter_ns()
        await real.draft(features, anchor_id, num_drafts)
        self.times.draft.append((time.perf_counter_ns() - began, real.last_forward_ns))
        self.times.batch_sizes["draft"].append(real.last_batch_size)
        return await self.script.draft(features, anchor_id, num_drafts)

    async def close(self):
        await self.real.close()


@dataclass
class RequestResult:
    tokens: list[int]
    ttft_s: float
    total_s: float
    times: StepTimes
    opened_s: float  # the target's session open (the rest of ttft_s is the prefill)

    @property
    def tpot_s(self) -> float:
        return (self.total_s - self.ttft_s) / max(len(self.tokens) - 1, 1)


async def run_request(
    target,
    drafter,
    prompt,
    max_new,
    continuation=None,
    tau=None,
    vocab=0,
    transport="inline",
    shared=None,
    max_context=None,
):
    """One greedy request; with `drafter` None it is target-only (the continuation oracle)."""
    times = StepTimes()
    if max_context is None:  # the session's own limit, as the gateway uses it
        max_context = (await target.info()).max_context_tokens
    began = time.perf_counter()
    use_drafter = drafter is not None and tau is not None
    drafter_session = None
    if use_drafter:  # as the gateway opens them: both at once, the prompt right after the
        # target's open, the drafter's open awaited at the first draft (pending_drafter.py)
        opening = drafter.open(transport, shared) if shared else drafter.open(transport)
        real = PendingDrafterSession(opening)
        drafter_session = ImposedAcceptanceDrafter(real, continuation, tau, vocab, times)
    session = None
    try:
        session = TimedTarget(
            await target.open(SamplingParams(), transport if use_drafter else "none"), times
        )
        opened = time.perf_counter() - began
        gen = SpeculativeGeneration(
            session, drafter_session, prompt, StopRules(max_new), 15, max_context
        )
        tokens, ttft = [], None
        async for step_ids in gen.steps():  # a step at a time, as the gateway takes them
            tokens.extend(step_ids)
            ttft = ttft if ttft is not None else time.perf_counter() - began
        total = time.perf_counter() - began
    finally:
        if session is not None:
            await session.close()
        if drafter_session is not None:
            await drafter_session.close()
    if gen.drafter_error is not None:  # never measure a target-only run as a drafted one
        raise RuntimeError(f"the drafter failed: {gen.drafter_error!r}") from gen.drafter_error
    return RequestResult(tokens, ttft, total, times, opened)


def overhead_fraction(times: StepTimes) -> float:
    """Share of step wall time that is not a model forward (verify + draft per step)."""
    wall = sum(w for w, _ in times.verify) + sum(w for w, _ in times.draft)
    forward = sum(f for _, f in times.verify) + sum(f for _, f in times.draft)
    return (wall - forward) / wall if wall else 0.0


def summarize(result: RequestResult, target_only_tokens: list[int]) -> dict:
    """Speed figures, plus whether the output equalled target-only decoding and the τ
    actually achieved (scripted drafts stop matching after a divergence)."""
    first_difference = next(
        (
            i
            for i, (a, b) in enumerate(zip(result.tokens, target_only_tokens, strict=False))
            if a != b
        ),
        None,
    )
    steps = max(len(result.times.verify), 1)
    return {
        "equals_target_only": result.tokens == target_only_tokens[: len(result.tokens)],
        "first_difference": first_difference,
        "achieved_tau": round((len(result.tokens) - 1) / steps, 2),
        "tok_s": round(len(result.tokens) / result.total_s, 2),
        "ttft_ms": round(result.ttft_s * 1e3, 2),
        "tpot_ms": round(result.tpot_s * 1e3, 3),
        "overhead_frac": round(overhead_fraction(result.times), 4),
        "num_steps": len(result.times.verify),
    }


async def concurrent_throughput(
    target, drafter, prompt, continuation, tau, vocab, count, max_new, transport, shared
) -> dict:
    """`count` identical requests at once: total generated tokens per second, and per request
    (means) its time to first token and its time after it, to tell prefill from decoding.
    The target's facts are asked once, before the clock starts, as the gateway asks them once
    at start-up: asked by every request, the `count` GetInfo calls spread the sessions' opens
    over milliseconds, and a prompt batch could start before the last sessions had opened."""
    max_context = (await target.info()).max_context_tokens
    step_trace.mark(f"round.{count}.start")  # a traced suite run's rounds, told apart
    began = time.perf_counter()
    results = await asyncio.gather(
        *(
            run_request(
                target, drafter, prompt, max_new, continuation, tau, vocab, transport, shared,
                max_context,
            )
            for _ in range(count)
        )
    )  # fmt: skip
    elapsed = time.perf_counter() - began
    step_trace.mark(f"round.{count}.end")

    def step_ms(pairs: list[tuple[int, int]]) -> dict:
        """Medians and maxima over all requests' steps of wall and forward time, in ms."""
        walls, forwards = [w / 1e6 for w, _ in pairs], [f / 1e6 for _, f in pairs]
        return {
            "median_wall": round(statistics.median(walls), 3) if walls else None,
            "max_wall": round(max(walls), 3) if walls else None,
            "median_forward": round(statistics.median(forwards), 3) if forwards else None,
            "max_forward": round(max(forwards), 3) if forwards else None,
        }

    return {
        "tok_s": round(sum(len(r.tokens) for r in results) / elapsed, 2),
        "mean_ttft_ms": round(statistics.mean(r.ttft_s for r in results) * 1e3, 2),
        # TTFT's parts: opening the two sessions, then the prefill (its forward and waits).
        "mean_open_ms": round(statistics.mean(r.opened_s for r in results) * 1e3, 2),
        "prefill_ms": step_ms([pair for r in results for pair in r.times.prefill]),
        "mean_decode_ms": round(statistics.mean(r.total_s - r.ttft_s for r in results) * 1e3, 2),
        "verify_ms": step_ms([pair for r in results for pair in r.times.verify]),
        "draft_ms": step_ms([pair for r in results for pair in r.times.draft]),
        # Without each request's first step, which may wait behind the other requests'
        # prefills (all start at once): separates that wait from later stalls (a later step
        # can still wait behind a prefill that arrived late).
        "verify_ms_after_first": step_ms([p for r in results for p in r.times.verify[1:]]),
        "draft_ms_after_first": step_ms([p for r in results for p in r.times.draft[1:]]),
        "split_waves": {
            kind: split_waves([r.times.batch_sizes[kind] for r in results])
            for kind in ("prefill", "verify", "draft")
        },
        "slowest_steps": {
            kind: slowest_step([r.times for r in results], kind)
            for kind in ("prefill", "verify", "draft")
        },
    }


def slowest_step(times: list[StepTimes], kind: str) -> dict | None:
    """The step of this kind with the longest wall time over all requests: which request and
    step it was, its wall and forward time (a wall far above its forward waited outside the
    engine: transport, a queue, a stalled process) and the size of its batch."""
    steps = []
    for request, request_times in enumerate(times):
        pairs, sizes = getattr(request_times, kind), request_times.batch_sizes[kind]
        for index, ((wall, forward), size) in enumerate(zip(pairs, sizes, strict=True)):
            steps.append((wall, forward, request, index, size))
    if not steps:
        return None
    wall, forward, request, index, size = max(steps, key=lambda step: step[0])
    return {
        "request": request,
        "step": index,
        "wall_ms": round(wall / 1e6, 3),
        "forward_ms": round(forward / 1e6, 3),
        "batch_size": size,
    }


def split_waves(sizes_per_request: list[list[int]]) -> dict[str, dict[int, int]]:
    """The steps at which requests that move in lockstep (identical, started together) did
    not all share one forward: {step index: {batch size: requests in a batch that size}}.
    A wave of 8 split as 5 + 3 reads {5: 5, 3: 3}, one split as 3 + 3 + 2 {3: 6, 2: 2}
    (a forward may also hold another request's step of another kind: a prompt's blocks)."""
    waves = {}
    count = len(sizes_per_request)
    for index, sizes in enumerate(zip(*sizes_per_request, strict=False)):
        if any(size != count for size in sizes):
            waves[str(index)] = dict(sorted(collections.Counter(sizes).items(), reverse=True))
    return waves


def http_stream_request(base_url: str, prompt_ids: list[int], max_tokens: int) -> dict:
    """One greedy streamed /v1/completions request: time to first content chunk and total."""
    import json
    import urllib.request

    body = {
        "prompt": prompt_ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    request = urllib.request.Request(
        base_url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    began = time.perf_counter()
    first, usage = None, None
    with urllib.request.urlopen(request, timeout=600) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if chunk.get("usage"):
                usage = chunk["usage"]
            if first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                first = time.perf_counter() - began
    total = time.perf_counter() - began
    return {
        "ttft_s": first if first is not None else total,
        "total_s": total,
        "completion_tokens": usage["completion_tokens"] if usage else 0,
    }
