"""Greedy generations of the trained target: the drafter's training labels.

DFlash drafters learn to predict what the target itself says, so the labels come from the
target's own greedy continuations of the training prompts. Prompts of equal length run
together in lockstep (one batched forward per token), through the serving model's prefill
path with a fresh state per group.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from target_service.model.decoder import Qwen35TextModel
from target_service.model.forward_batch import ForwardBatch
from target_service.model.state import StateShape, TargetState


@torch.inference_mode()
def generate_greedy(
    model: Qwen35TextModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_token_ids: list[int],
    max_batch: int = 512,
    log=print,
) -> list[list[int]]:
    """Each prompt's greedy continuation, up to and including its first EOS token."""
    by_length: dict[int, list[int]] = defaultdict(list)
    for index, prompt in enumerate(prompts):
        by_length[len(prompt)].append(index)
    outputs: list[list[int]] = [[] for _ in prompts]
    done_prompts = 0
    for length in sorted(by_length):
        indices = by_length[length]
        for first in range(0, len(indices), max_batch):
            group = indices[first : first + max_batch]
            rows = _generate_group(
                model, [prompts[i] for i in group], max_new_tokens, eos_token_ids
            )
            for index, row in zip(group, rows, strict=True):
                outputs[index] = row
            done_prompts += len(group)
        log(f"  generated for {done_prompts}/{len(prompts)} prompts")
    return outputs


def _generate_group(model, prompts, max_new_tokens, eos_token_ids) -> list[list[int]]:
    device = model.embed_tokens.weight.device
    num_rows, length = len(prompts), len(prompts[0])
    shape = StateShape(max_slots=num_rows, max_len=length + max_new_tokens)
    state = TargetState(model.config, shape, model.embed_tokens.weight.dtype, device)
    slots = tuple(range(num_rows))
    eos = torch.tensor(eos_token_ids, device=device)
    token_ids = torch.tensor(prompts, device=device)
    hidden, _ = model(token_ids, ForwardBatch(slots, (0,) * num_rows, length, False), state)
    next_ids = model.logits(hidden[:, -1]).argmax(-1)
    generated = [next_ids]
    is_done = torch.isin(next_ids, eos)
    for step in range(1, max_new_tokens):
        if bool(is_done.all()):
            break
        position = length + step - 1
        batch = ForwardBatch(slots, (position,) * num_rows, 1, False)
        hidden, _ = model(next_ids.unsqueeze(1), batch, state)
        next_ids = model.logits(hidden[:, -1]).argmax(-1)
        generated.append(next_ids)
        is_done |= torch.isin(next_ids, eos)
    table = torch.stack(generated, dim=1).tolist()
    eos_set = set(eos_token_ids)
    rows = []
    for row in table:
        cut = next((i + 1 for i, token in enumerate(row) if token in eos_set), len(row))
        rows.append(row[:cut])
    return rows
