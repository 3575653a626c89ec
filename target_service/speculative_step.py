"""The target's half of a speculative step: choose its tokens, accept, commit.

`verify_and_commit` runs the blocks of many sessions in one forward (whatever their lengths). For a
block [anchor, d1..dk] at positions p..p+k, logits row i gives the target's token y_i at
position p+i+1; drafts are accepted while d_{i+1} == y_i; the anchor and the accepted drafts
are committed and y_accepted becomes the next anchor.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dflash_serve.errors import DflashError
from dflash_serve.sampling import choose_tokens
from dflash_serve.speculative.types import SamplingParams, TargetStep
from target_service.engine import TargetEngine


@dataclass(frozen=True)
class VerifyRequest:
    slot: int
    block_ids: list[int]
    sampling: SamplingParams
    keep_all: bool = False  # a block of the prompt: every token is committed, none checked


def prefill_and_choose(
    engine: TargetEngine, slot: int, prompt_ids: list[int], sampling: SamplingParams
) -> TargetStep:
    """Commit the prompt and choose the target's first token (position len(prompt))."""
    began_ns = time.perf_counter_ns()
    result = engine.prefill(slot, prompt_ids)
    position = torch.tensor([len(prompt_ids)], device=result.last_logits.device)
    token = int(choose_tokens(result.last_logits.unsqueeze(0), position, sampling)[0])
    return TargetStep([token], 0, result.taps, 0, time.perf_counter_ns() - began_ns)


def prefill_result(block_steps: list[TargetStep], began_ns: int) -> TargetStep:
    """The prefill's step from the steps of its prompt blocks (verified with keep_all): the
    target's token after the last block, the features of every prompt token."""
    features = [step.features for step in block_steps]
    taps = None if features[0] is None else torch.cat(features)
    last = block_steps[-1]
    elapsed_ns = time.perf_counter_ns() - began_ns
    return TargetStep([last.token_ids[-1]], 0, taps, 0, elapsed_ns, last.batch_size)


def count_accepted(drafts: list[int], target_tokens: list[int]) -> int:
    """Length of the longest prefix where each draft equals the target's token there."""
    accepted = 0
    for draft, token in zip(drafts, target_tokens, strict=False):
        if draft != token:
            break
        accepted += 1
    return accepted


def verify_and_commit(
    engine: TargetEngine, requests: Sequence[VerifyRequest]
) -> list[TargetStep | DflashError]:
    """One result per request, in order; an invalid request gets its error, the others run
    in one forward (blocks of different lengths padded to the longest)."""
    results: list[TargetStep | DflashError | None] = [None] * len(requests)
    valid = []
    for index, request in enumerate(requests):
        try:
            engine.check_block(request.slot, request.block_ids)
        except DflashError as error:
            results[index] = error
            continue
        valid.append(index)
    if valid:
        _verify_group(engine, [requests[i] for i in valid], valid, results)
    return results


def _verify_group(engine, group, indices, results) -> None:
    began_ns = time.perf_counter_ns()
    slots = [r.slot for r in group]
    starts = [engine.length(s) for s in slots]
    output = engine.verify(slots, [r.block_ids for r in group])
    steps = []
    for row, (request, start) in enumerate(zip(group, starts, strict=True)):
        num_tokens = len(request.block_ids)
        logits = output.logits[row, :num_tokens]
        positions = torch.arange(start + 1, start + 1 + num_tokens, device=logits.device)
        if request.keep_all:  # only the token after the block is chosen
            last = choose_tokens(logits[-1:], positions[-1:], request.sampling)
            tokens, accepted = request.block_ids[1:] + last.tolist(), num_tokens - 1
        else:
            tokens = choose_tokens(logits, positions, request.sampling).tolist()
            accepted = count_accepted(request.block_ids[1:], tokens)
        engine.commit(request.slot, accepted + 1)
        features = None if output.taps is None else output.taps[row, : accepted + 1].clone()
        steps.append((tokens[: accepted + 1], accepted, features, start))
    elapsed_ns = time.perf_counter_ns() - began_ns
    for index, step in zip(indices, steps, strict=True):
        results[index] = TargetStep(*step, forward_ns=elapsed_ns, batch_size=len(group))
