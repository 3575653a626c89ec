"""CUDA graphs of the drafter's draft step (forward + greedy pick), one per batch size.

Captured once at start-up for full blocks (anchor + 15 drafts: what a speculative step asks
for unless pacing shortens it); any other shape runs the same kernels eagerly, so results are
identical either way. The graph's input is one int64 buffer [2 + T, B]: slots, start positions
(the slots' context lengths), then the block token ids by position. Its output is the greedy
draft ids computed on the GPU, so the host copies T − 1 ints per sequence, not T − 1 rows of
vocabulary-sized logits.
"""

from __future__ import annotations

import torch

from dflash_serve.cuda_graphs import StepGraphs
from drafter_service.model.context_cache import DrafterContextCache
from drafter_service.model.dflash import DFlashDrafter

DRAFT_BLOCK_TOKENS = 16


class DraftGraphs:
    """Captured draft steps; `replay` returns None for shapes that were not captured."""

    def __init__(
        self,
        model: DFlashDrafter,
        cache: DrafterContextCache,
        batch_sizes: tuple[int, ...],
        block_tokens: int = DRAFT_BLOCK_TOKENS,
    ) -> None:
        """Captures immediately, on a model already on its GPU kernels; must run before any
        slot holds context (it writes scratch block keys at positions 0..T-1 of slots
        0..B-1, which `add_context` overwrites). Every batch size must be <= cache.max_slots."""
        self.model = model
        self.cache = cache
        device = model.embed_weight.device
        warmup = {}
        for batch_size in batch_sizes:
            inputs = torch.zeros((2 + block_tokens, batch_size), dtype=torch.int64, device=device)
            inputs[0] = torch.arange(batch_size, device=device)
            warmup[(batch_size, block_tokens)] = inputs
        self.graphs = StepGraphs(self._draft, warmup)

    def _draft(self, inputs: torch.Tensor, key: tuple[int, int]) -> tuple[torch.Tensor]:
        logits = self.model.draft_logits_on_device(self.cache, inputs[0], inputs[1], inputs[2:].t())
        return (logits.argmax(dim=-1),)

    def replay(
        self, slots: list[int], starts: list[int], block_ids: list[list[int]]
    ) -> torch.Tensor | None:
        """Greedy draft ids [B, T − 1] int64 (on the GPU) as the eager step gives them, or None."""
        key = (len(slots), len(block_ids[0]))
        if not self.graphs.has(key):
            return None
        host = torch.tensor([slots, starts, *zip(*block_ids, strict=True)], dtype=torch.int64)
        (draft_ids,) = self.graphs.replay(key, host)
        return draft_ids
