"""CUDA graphs of the target's verify forward (model + head), one per (sequences, tokens).

Captured once at start-up for the batch sizes the scheduler forms and the two block lengths
that matter (1: plain decoding, 16: a full speculative block); any other shape runs the same
kernels eagerly, so results are identical either way. The graph's input is one int64 buffer
[2 + T, B]: slots, start positions, then the token ids by position.
"""

from __future__ import annotations

import torch

from dflash_serve.cuda_graphs import StepGraphs
from target_service.model.decoder import Qwen35TextModel
from target_service.model.forward_batch import ForwardBatch
from target_service.model.state import TargetState

GRAPH_BLOCK_TOKENS = (1, 16)


class VerifyGraphs:
    """Captured verify forwards; `replay` returns None for shapes that were not captured."""

    def __init__(
        self,
        model: Qwen35TextModel,
        state: TargetState,
        tap_layer_ids: tuple[int, ...],
        batch_sizes: tuple[int, ...],
        block_tokens: tuple[int, ...] = GRAPH_BLOCK_TOKENS,
    ) -> None:
        """Captures immediately; must run before any sequence holds state (it writes slots
        0..B-1's block buffers and KV positions 0..T-1, which opening a sequence resets)."""
        self.model = model
        self.state = state
        self.tap_layer_ids = tap_layer_ids
        device = model.embed_tokens.weight.device
        warmup = {}
        for num_tokens in block_tokens:
            for batch_size in batch_sizes:
                inputs = torch.zeros((2 + num_tokens, batch_size), dtype=torch.int64, device=device)
                inputs[0] = torch.arange(batch_size, device=device)
                warmup[(batch_size, num_tokens)] = (inputs,)
        self.graphs = StepGraphs(self._forward, warmup)

    def _forward(self, inputs: tuple[torch.Tensor], key: tuple[int, int]):
        (inputs,) = inputs
        batch_size, num_tokens = key
        slots = tuple(range(batch_size))  # only for the record: the kernel path reads tensors
        batch = ForwardBatch(slots, (0,) * batch_size, num_tokens, True, inputs[0], inputs[1])
        hidden, taps = self.model(inputs[2:].t(), batch, self.state, self.tap_layer_ids)
        return self.model.logits(hidden), taps

    def replay(
        self, slots: list[int], starts: tuple[int, ...], block_ids: list[list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(logits [B, T, vocab] fp32, taps) as the eager forward gives them, or None."""
        key = (len(slots), len(block_ids[0]))
        if not self.graphs.has(key):
            return None
        host = torch.tensor([slots, list(starts), *zip(*block_ids, strict=True)])
        logits, taps = self.graphs.replay(key, host)
        return logits, taps
