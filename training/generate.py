"""Greedy generations of the trained target: the drafter's training labels.

DFlash drafters learn to predict what the target itself says, so the labels come from the
target's own greedy continuations of the training prompts, through the serving model's own
prefill and decode paths. Up to `max_batch` prompts share one state: each distinct prompt
length is prefilled in one forward, then every unfinished row decodes in lockstep (one
batched forward per token, each row at its own position), and a row leaves the batch at
its EOS.

Batches are built from prompts of one length where there are at least `min_group_rows`
of them: their rows stay at one position, which the plain attention path computes for all
rows at once. Rows at different positions attend one by one there (all batches mixed, the
H200 took 337 s for 14,192 answers, ~63 ms a step at ~290 rows; on the CPU 768 training
questions took 121 s mixed, 97 s in batches of one length, same answers), so only the
prompts of rare lengths share mixed batches, which still beats running each rare length
alone (CPU, invented questions: 29 prompts in 213 s by length alone, 256 in 55 s mixed).

With `verify_decode` (by default: when the attention layers run the kernel, as
`load_generating_target` sets them up on the GPU) each token is decoded as a one-token
verify block and committed at once, as the serving engine decodes: rows at different
positions then attend in one kernel launch, which prompts of many lengths (the grounded
conversations quote documentation of any length) need.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from target_service.model.commit import commit_blocks
from target_service.model.decoder import Qwen35TextModel
from target_service.model.forward_batch import ForwardBatch
from target_service.model.gated_attention import GatedAttention
from target_service.model.loader import load_target_model
from target_service.model.state import StateShape, TargetState


@torch.inference_mode()
def generate_greedy(
    model: Qwen35TextModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_token_ids: list[int],
    max_batch: int = 512,
    log=print,
    min_group_rows: int = 64,
    verify_decode: bool | None = None,
) -> list[list[int]]:
    """Each prompt's greedy continuation, up to and including its first EOS token."""
    if verify_decode is None:
        verify_decode = runs_attention_kernel(model)
    outputs: list[list[int]] = [[] for _ in prompts]
    done = 0
    for group in prompt_batches(prompts, max_batch, min_group_rows):
        rows = _generate_group(
            model, [prompts[i] for i in group], max_new_tokens, eos_token_ids, verify_decode
        )
        for index, row in zip(group, rows, strict=True):
            outputs[index] = row
        done += len(group)
        log(f"  generated for {done}/{len(prompts)} prompts")
    return outputs


def prompt_batches(
    prompts: list[list[int]], max_batch: int, min_group_rows: int
) -> list[list[int]]:
    """Prompt indices in batches of at most `max_batch`: one length per batch for lengths
    with at least `min_group_rows` prompts, the other prompts pooled by length order."""
    by_length = indices_by_length(prompts)
    batches, pooled = [], []
    for length in sorted(by_length):
        indices = by_length[length]
        if len(indices) < min_group_rows:
            pooled += indices
            continue
        batches += [indices[i : i + max_batch] for i in range(0, len(indices), max_batch)]
    batches += [pooled[i : i + max_batch] for i in range(0, len(pooled), max_batch)]
    return batches


def indices_by_length(prompts: list[list[int]]) -> dict[int, list[int]]:
    """The prompts' indices grouped by prompt length, in index order within a length."""
    by_length: dict[int, list[int]] = defaultdict(list)
    for index, prompt in enumerate(prompts):
        by_length[len(prompt)].append(index)
    return by_length


def load_generating_target(target_dir, device: str) -> Qwen35TextModel:
    """The target as training generates with it: bf16 with the attention kernel on CUDA
    (`use_attention_kernel`), fp32 on the CPU, in eval mode."""
    on_gpu = torch.device(device).type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    model = load_target_model(target_dir, dtype, device).eval()
    if on_gpu:
        use_attention_kernel(model)
    return model


def use_attention_kernel(model: Qwen35TextModel) -> None:
    """Verify blocks of the target's attention layers on the Triton kernel (CUDA only), the
    rest of the model unchanged: what `verify_decode` needs to batch rows at any position."""
    for module in model.modules():
        if isinstance(module, GatedAttention):
            module.use_gpu_kernels()


def runs_attention_kernel(model: Qwen35TextModel) -> bool:
    return any(
        isinstance(module, GatedAttention) and module.attention_kernel is not None
        for module in model.modules()
    )


def _generate_group(
    model, prompts, max_new_tokens, eos_token_ids, verify_decode
) -> list[list[int]]:
    device = model.embed_tokens.weight.device
    num_rows = len(prompts)
    lengths = [len(p) for p in prompts]
    shape = StateShape(max_slots=num_rows, max_len=max(lengths) + max_new_tokens)
    state = TargetState(model.config, shape, model.embed_tokens.weight.dtype, device)
    next_ids = torch.empty(num_rows, dtype=torch.int64, device=device)
    for length, rows in indices_by_length(prompts).items():
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
        starts = tuple(lengths[r] + step - 1 for r in active)
        batch = ForwardBatch(tuple(active), starts, 1, verify_decode)
        last = torch.tensor([generated[r][-1] for r in active], device=device)
        hidden, _ = model(last.unsqueeze(1), batch, state)
        if verify_decode:
            for row in active:
                state.block_sizes[row] = state.block_run_sizes[row] = 1
            commit_blocks(state, active, [1] * len(active), model.recurrence_kernel)
        chosen = model.logits(hidden[:, -1]).argmax(-1).tolist()
        for row, token in zip(active, chosen, strict=True):
            generated[row].append(token)
        active = [r for r in active if generated[r][-1] not in eos]
    return generated
