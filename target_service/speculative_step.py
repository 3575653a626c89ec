"""The target's half of a speculative step: choose its tokens, accept, commit.

`verify_and_commit` runs the blocks of many sessions in one forward (whatever their lengths). For a
block [anchor, d1..dk] at positions p..p+k, logits row i gives the target's token y_i at
position p+i+1; drafts are accepted while d_{i+1} == y_i; the anchor and the accepted drafts
are committed and y_accepted becomes the next anchor. `run_target_batch`, the target's batch
function, also takes the prompts of sessions starting together (`PrefillRequest`) and
prefills those of one run length in shared forwards.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dflash_serve.errors import DflashError, InvalidRequestError
from dflash_serve.sampling import choose_block_tokens, choose_tokens
from dflash_serve.speculative.types import SamplingParams, TargetStep
from target_service.engine import TargetEngine

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VerifyRequest:
    slot: int
    block_ids: list[int]
    sampling: SamplingParams
    keep_all: bool = False  # a block of the prompt: every token is committed, none checked


@dataclass(frozen=True)
class PrefillRequest:
    """A prompt from position 0 that may share its forward (`TargetEngine.shares_prefills`)."""

    slot: int
    prompt_ids: list[int]
    sampling: SamplingParams


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
    """One forward, one host sync for every block's tokens, one commit for the batch."""
    began_ns = time.perf_counter_ns()
    slots = [r.slot for r in group]
    starts = [engine.length(s) for s in slots]
    blocks = [r.block_ids for r in group]
    output = engine.verify(slots, blocks)
    lengths = [len(block) for block in blocks]
    first_rows = [n - 1 if r.keep_all else 0 for r, n in zip(group, lengths, strict=True)]
    params = [r.sampling for r in group]
    chosen = choose_block_tokens(output.logits, starts, lengths, params, first_rows)
    kept_tokens = []
    for request, tokens in zip(group, chosen, strict=True):
        if request.keep_all:  # a prompt block: only the token after it is chosen
            kept_tokens.append(request.block_ids[1:] + tokens)
        else:
            accepted = count_accepted(request.block_ids[1:], tokens)
            kept_tokens.append(tokens[: accepted + 1])
    engine.commit_many(slots, [len(tokens) for tokens in kept_tokens])
    steps = []
    for row, (tokens, start) in enumerate(zip(kept_tokens, starts, strict=True)):
        features = None if output.taps is None else output.taps[row, : len(tokens)].clone()
        steps.append((tokens, len(tokens) - 1, features, start))
    elapsed_ns = time.perf_counter_ns() - began_ns
    for index, step in zip(indices, steps, strict=True):
        results[index] = TargetStep(*step, forward_ns=elapsed_ns, batch_size=len(group))


def run_target_batch(
    engine: TargetEngine, requests: Sequence[VerifyRequest | PrefillRequest]
) -> list[TargetStep | BaseException]:
    """One result per request, in order: the prompts first, those of one run length in
    forwards of `prefill_group_size` rows, then every block in one `verify_and_commit`. A
    prefill forward that fails fails its own prompts (nothing of them committed), not the
    batch's other requests."""
    results: list[TargetStep | BaseException | None] = [None] * len(requests)
    groups: dict[int, list[int]] = defaultdict(list)
    verifies = []
    for index, request in enumerate(requests):
        if isinstance(request, VerifyRequest):
            verifies.append(index)
            continue
        try:
            engine.check_prompt(request.slot, request.prompt_ids)
            run_tokens = engine.prefill_run_length(request.slot, len(request.prompt_ids))
            if run_tokens is None:
                raise InvalidRequestError(
                    f"slot {request.slot}: a shared prefill starts at position 0"
                )
        except DflashError as error:
            results[index] = error
            continue
        groups[run_tokens].append(index)
    for run_tokens, indices in groups.items():
        size = engine.prefill_group_size(run_tokens)
        for first in range(0, len(indices), size):
            group = indices[first : first + size]
            try:
                steps = prefill_together_and_choose(engine, [requests[i] for i in group])
            except Exception as error:  # handed to the group's waiters
                logger.exception("prefill of %d prompts failed", len(group))
                steps = [error] * len(group)
            for index, step in zip(group, steps, strict=True):
                results[index] = step
    if verifies:
        try:
            outcomes = verify_and_commit(engine, [requests[i] for i in verifies])
        except Exception as error:  # the blocks' error, not the prompts' (committed above)
            logger.exception("verify of %d blocks failed", len(verifies))
            outcomes = [error] * len(verifies)
        for index, outcome in zip(verifies, outcomes, strict=True):
            results[index] = outcome
    return results


def prefill_together_and_choose(
    engine: TargetEngine, requests: Sequence[PrefillRequest]
) -> list[TargetStep]:
    """`prefill_and_choose` for prompts of one run length in one forward (one host sync).
    If choosing fails (where an asynchronous GPU error of the forward also surfaces), the
    prompts are reset too: nothing of them stays committed."""
    began_ns = time.perf_counter_ns()
    slots = [r.slot for r in requests]
    results = engine.prefill_together(slots, [r.prompt_ids for r in requests])
    logits = torch.stack([result.last_logits for result in results]).unsqueeze(1)
    starts = [len(r.prompt_ids) - 1 for r in requests]  # row 0 predicts position len(prompt)
    ones = [1] * len(requests)
    try:
        chosen = choose_block_tokens(
            logits, starts, ones, [r.sampling for r in requests], [0] * len(requests)
        )
    except Exception:
        for slot in slots:
            engine.reset_sequence(slot)
        raise
    elapsed_ns = time.perf_counter_ns() - began_ns
    return [
        TargetStep(tokens, 0, result.taps, 0, elapsed_ns, len(requests))
        for tokens, result in zip(chosen, results, strict=True)
    ]
