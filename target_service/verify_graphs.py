"""CUDA graphs of the target's verify forward (model + head), one per (sequences, tokens).

Captured once at start-up for the batch sizes the scheduler forms and two block lengths
(1: plain decoding, 16: a full speculative block). A block of another length runs in the
next longer graph, padded after its last token: the padding rows come after every real row,
and the kernels are causal and row-independent, so the real rows' logits, taps and recorded
GDN inputs are those of the unpadded block bit for bit (an eager forward of 2..15 tokens
costs thousands of kernel launches, more than a padded graph). Batch sizes that were not
captured run the same kernels eagerly. The graph's input is one int64 buffer [2 + T, B]:
slots, start positions, then the token ids by position.
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

    def replay(
        self, slots: list[int], starts: tuple[int, ...], block_ids: list[list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor | None, int] | None:
        """(logits [B, T, vocab] fp32, taps [B, T, ...], tokens the forward ran) as the eager
        forward of the T-token blocks gives them, or None when no graph fits this batch.

        The forward ran the shortest captured length >= T; the state's KV cache has room
        for its padding past any committed length (TargetState)."""
        num_tokens = len(block_ids[0])
        run_tokens = next(
            (t for t in self.block_tokens if t >= num_tokens and self.graphs.has((len(slots), t))),
            None,
        )
        if run_tokens is None:
            return None
        padded = [block + [block[-1]] * (run_tokens - num_tokens) for block in block_ids]
        host = torch.tensor([slots, list(starts), *zip(*padded, strict=True)])
        logits, taps = self.graphs.replay((len(slots), run_tokens), host)
        if run_tokens > num_tokens:
            logits = logits[:, :num_tokens]
            taps = None if taps is None else taps[:, :num_tokens]
        return logits, taps, run_tokens
