"""Greedy generations of the trained target: the drafter's training labels.

DFlash drafters learn to predict what the target itself says, so the labels come from the
target's own greedy continuations of the training prompts. Up to `max_batch` prompts share
one state: each distinct prompt length is prefilled in one forward, then every unfinished
row decodes in lockstep (one batched forward per token, each row at its own position), and
a row leaves the batch at its EOS. Prompts of many lengths (invented questions) therefore
still run hundreds at a time, through the serving model's own prefill and decode paths.
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
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    outputs: list[list[int]] = [[] for _ in prompts]
    for first in range(0, len(order), max_batch):
        group = order[first : first + max_batch]
        rows = _generate_group(model, [prompts[i] for i in group], max_new_tokens, eos_token_ids)
        for index, row in zip(group, rows, strict=True):
            outputs[index] = row
        log(f"  generated for {first + len(group)}/{len(prompts)} prompts")
    return outputs


def _generate_group(model, prompts, max_new_tokens, eos_token_ids) -> list[list[int]]:
    device = model.embed_tokens.weight.device
    num_rows = len(prompts)
    lengths = [len(p) for p in prompts]
    shape = StateShape(max_slots=num_rows, max_len=max(lengths) + max_new_tokens)
    state = TargetState(model.config, shape, model.embed_tokens.weight.dtype, device)
    by_length: dict[int, list[int]] = defaultdict(list)
    for row, length in enumerate(lengths):
        by_length[length].append(row)
    next_ids = torch.empty(num_rows, dtype=torch.int64, device=device)
    for length, rows in by_length.items():
        token_ids = torch.tensor([prompts[r] for r in rows], device=device)
        batch = ForwardBatch(tuple(rows), (0,) * len(rows), length, False)
        hidden, _ = model(token_ids, batch, state)
        next_ids[torch.tensor(rows, device=device)] = model.logits(hidden[:, -1]).argmax(-1)
    eos = set(eos_token_ids)
    generated = [[int(t)] for t in next_ids.tolist()]
    active = [r for r in range(num_rows) if generated[r][-1] not in eos]
    for step in range(1, max_new_tokens):
        if not active:
            break
        batch = ForwardBatch(tuple(active), tuple(lengths[r] + step - 1 for r in active), 1, False)
        last = torch.tensor([generated[r][-1] for r in active], device=device)
        hidden, _ = model(last.unsqueeze(1), batch, state)
        chosen = model.logits(hidden[:, -1]).argmax(-1).tolist()
        for row, token in zip(active, chosen, strict=True):
            generated[row].append(token)
        active = [r for r in active if generated[r][-1] not in eos]
    return generated
