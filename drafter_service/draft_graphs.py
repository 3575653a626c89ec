"""CUDA graphs of the drafter's speculative step: add the committed context, then draft.

One graph per batch size, for full blocks (anchor + 15 drafts: what a speculative step asks
for unless pacing shortens it) after at most one block's worth of new context (the engine
adds any earlier rows eagerly first); any other shape runs the same kernels eagerly, so
results are identical either way. The context rows
are padded to `MAX_NEW_CONTEXT`: padding rows land beyond the slot's length, where the
draft block then overwrites them, so they are never attended. Inputs: an int64 buffer
[3 + T, B] (slots, context lengths before the step, new context rows, then the block ids by
position) and the features [B, MAX_NEW_CONTEXT, taps·hidden]. Output: the greedy draft ids,
computed on the GPU, so the host copies T − 1 ints per sequence, not vocabulary-sized logits.
"""

from __future__ import annotations

import torch

from dflash_serve.cuda_graphs import StepGraphs
from drafter_service.model.context_cache import DrafterContextCache
from drafter_service.model.dflash import DFlashDrafter

DRAFT_BLOCK_TOKENS = 16
MAX_NEW_CONTEXT = 16  # a step commits at most a block; more rows are added first


class DraftGraphs:
    """Captured add-context-and-draft steps; `replay` returns None for other shapes."""

    def __init__(
        self,
        model: DFlashDrafter,
        cache: DrafterContextCache,
        batch_sizes: tuple[int, ...],
        block_tokens: int = DRAFT_BLOCK_TOKENS,
    ) -> None:
        """Captures immediately, on a model already on its GPU kernels; must run before any
        slot holds context (it writes scratch keys at positions 0..31 of slots 0..B-1, which
        later context overwrites). Every batch size must be <= cache.max_slots."""
        self.model = model
        self.cache = cache
        self.block_tokens = block_tokens
        self.device = model.embed_weight.device
        self.feature_dim = model.fc.weight.shape[1]
        warmup = {}
        for batch_size in batch_sizes:
            ints = torch.zeros(
                (3 + block_tokens, batch_size), dtype=torch.int64, device=self.device
            )
            ints[0] = torch.arange(batch_size, device=self.device)
            features = torch.zeros(
                (batch_size, MAX_NEW_CONTEXT, self.feature_dim),
                dtype=model.fc.weight.dtype,
                device=self.device,
            )
            warmup[batch_size] = (ints, features)
        self.graphs = StepGraphs(self._add_and_draft, warmup)

    def _add_and_draft(self, inputs, batch_size: int) -> tuple[torch.Tensor]:
        ints, features = inputs
        slot_ids, starts, num_new = ints[0], ints[1], ints[2]
        self.model.add_context_on_device(self.cache, slot_ids, starts, features)
        block_ids = ints[3:].t()
        logits = self.model.draft_logits_on_device(
            self.cache, slot_ids, starts + num_new, block_ids
        )
        return (logits.argmax(dim=-1),)

    def accepts(self, num_sequences: int, block_tokens: int, num_new: list[int]) -> bool:
        return (
            self.graphs.has(num_sequences)
            and block_tokens == self.block_tokens
            and max(num_new) <= MAX_NEW_CONTEXT
        )

    def replay(
        self,
        slots: list[int],
        starts: list[int],
        features: list[torch.Tensor],
        block_ids: list[list[int]],
    ) -> torch.Tensor:
        """Greedy draft ids [B, T − 1] int64 (on the GPU) after adding each slot's new
        context features [n_b, taps·hidden] at its start; `accepts` must hold."""
        num_new = [f.shape[0] for f in features]
        ints = torch.tensor([slots, starts, num_new, *zip(*block_ids, strict=True)])
        padded = torch.zeros(
            (len(slots), MAX_NEW_CONTEXT, self.feature_dim),
            dtype=self.model.fc.weight.dtype,
            device=self.device,
        )
        for row, rows in enumerate(features):
            padded[row, : rows.shape[0]] = rows
        (draft_ids,) = self.graphs.replay(len(slots), ints, padded)
        return draft_ids
