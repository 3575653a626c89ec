"""CUDA graphs of the target's verify forward (model + head), one per (sequences, tokens).

Captured once at start-up for the batch sizes the scheduler forms and two block lengths
(1: plain decoding, 16: a full speculative block). Blocks of another length run in the next
longer graph (`run_length`), padded by the engine after their last token (an eager forward
of 2..15 tokens costs thousands of kernel launches, more than a padded graph). Batch sizes
that were not captured run the same kernels eagerly. The graph's input is one int64 buffer
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
        self.block_tokens = tuple(sorted(block_tokens))
        self.graphs = StepGraphs(self._forward, warmup)

    def _forward(self, inputs: tuple[torch.Tensor], key: tuple[int, int]):
        (inputs,) = inputs
        batch_size, num_tokens = key
        slots = tuple(range(batch_size))  # only for the record: the kernel path reads tensors
        batch = ForwardBatch(slots, (0,) * batch_size, num_tokens, True, inputs[0], inputs[1])
        hidden, taps = self.model(inputs[2:].t(), batch, self.state, self.tap_layer_ids)
        return self.model.logits(hidden), taps

    def run_length(self, batch_size: int, num_tokens: int) -> int | None:
        """The shortest captured block length >= num_tokens for this batch size, or None
        (the engine then runs the forward eagerly)."""
        return next(
            (t for t in self.block_tokens if t >= num_tokens and self.graphs.has((batch_size, t))),
            None,
        )

    def replay(
        self, slots: list[int], starts: tuple[int, ...], block_ids: list[list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits [B, T, vocab] fp32, taps) as the eager forward gives them, for blocks of a
        captured length T (`run_length`); the state's KV cache has room for padding past any
        committed length (TargetState)."""
        host = torch.tensor([slots, list(starts), *zip(*block_ids, strict=True)])
        logits, taps = self.graphs.replay((len(slots), len(block_ids[0])), host)
        return logits, taps
