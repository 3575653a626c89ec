"""The acceptance length a drafter would get when served, from the target's own generations.

Training's own estimate (`train_tau_estimate`: 1 + Σ P(slots 1..k right) over uniform random
anchors of full blocks, every sequence weighted alike; 9.0 logged for the shipped pair) reads
far above served τ: recomputed over every anchor of 100 training prompts it is 10.7, against
3.55 by this walk on the same generations, because served steps start where the last one
failed, which is where drafts are weakest. This replays greedy speculative decoding
instead: the drafter's block at every anchor of a generation (the packed training forward,
equal to the serving drafter up to float rounding), then the served loop's walk over them:
the first anchor is the first generated token; a step accepts the drafts' correct prefix and
emits it plus the target's token; the next anchor is that token. On the shipped pair's 20
training prompts it gave τ 3.950 where the engines, drafting every step, gave 3.955 (a
diagnosis run in /tmp, 2026-11-30).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from training.drafter_blocks import block_logits
from training.target_lm import forward_rows


@dataclass(frozen=True)
class WalkResult:
    tau: float  # mean tokens emitted per step (accepted drafts + the target's own)
    num_steps: int
    accept_per_position: list[float]  # fraction of steps whose draft k was accepted


def walk_accepted(
    correct_prefix: Sequence[int],
    answer: Sequence[int],
    max_new_tokens: int,
    num_drafts: int,
    eos_ids: Sequence[int],
) -> list[int]:
    """Accepted drafts per served step over one generation.

    answer: the target's greedy tokens (answer[0] is emitted by the prefill);
    correct_prefix[i]: how many drafts in a row are right from anchor answer[i] (the drafter's
    block there, compared with answer[i + 1:]). Steps continue while the anchor is not EOS,
    the answer has a next token and fewer than max_new_tokens are out; a step drafts
    min(num_drafts, the tokens still allowed after its own) and accepts the right prefix.
    """
    eos = set(eos_ids)
    accepted, anchor, emitted = [], 0, 1
    while anchor < len(answer) - 1 and emitted < max_new_tokens and answer[anchor] not in eos:
        budget = min(num_drafts, max_new_tokens - emitted - 1)
        if budget <= 0:
            break
        kept = min(correct_prefix[anchor], budget)
        accepted.append(kept)
        anchor += kept + 1
        emitted += kept + 1
    return accepted


@torch.no_grad()
def walk_steps(
    drafter,
    target,
    generations: Sequence[tuple[list[int], list[int]]],
    max_new_tokens: int,
    eos_ids: Sequence[int],
) -> list[list[int]]:
    """Accepted drafts per served step, for each (prompt ids, greedy answer ids) pair (none
    for an answer shorter than 2 tokens)."""
    device = drafter.fc.weight.device
    num_drafts = drafter.config.block_size - 1
    walks: list[list[int]] = []
    for prompt, answer in generations:
        if len(answer) < 2:
            walks.append([])
            continue
        token_ids = torch.tensor([list(prompt) + list(answer)], device=device)
        _, taps = forward_rows(target, token_ids, drafter.config.target_layer_ids)
        first = len(prompt)
        anchors = torch.arange(first, token_ids.shape[1] - 1, device=device).unsqueeze(0)
        drafts = block_logits(drafter, taps, token_ids, anchors)[0].argmax(-1).cpu()  # [A, K]
        labels = torch.full_like(drafts, -1)
        for index in range(drafts.shape[0]):
            following = answer[index + 1 : index + 1 + num_drafts]
            labels[index, : len(following)] = torch.tensor(following)
        correct_prefix = (drafts == labels).long().cumprod(-1).sum(-1).tolist()
        walks.append(walk_accepted(correct_prefix, answer, max_new_tokens, num_drafts, eos_ids))
    return walks


def walk_result(per_step: Sequence[int], num_drafts: int) -> WalkResult:
    """τ and per-position acceptance of served steps' accepted-draft counts."""
    steps = max(len(per_step), 1)
    return WalkResult(
        tau=round(1 + sum(per_step) / steps, 3),
        num_steps=len(per_step),
        accept_per_position=[
            round(sum(kept > k for kept in per_step) / steps, 3) for k in range(num_drafts)
        ],
    )


def walk_tau(
    drafter,
    target,
    generations: Sequence[tuple[list[int], list[int]]],
    max_new_tokens: int,
    eos_ids: Sequence[int],
) -> WalkResult:
    """Served-equivalent τ of `drafter` on (prompt ids, greedy answer ids) pairs."""
    walks = walk_steps(drafter, target, generations, max_new_tokens, eos_ids)
    return walk_result([kept for walk in walks for kept in walk], drafter.config.block_size - 1)
