"""Prompts from position 0 prefilled at a few fixed lengths, padded, as CUDA graphs.

An eager prefill forward is some 900 kernel launches: on an H200 ~50 ms of host time, which
the GPU waits for on prompts below a few thousand tokens (a 512-token prefill's GPU work is
~14 ms). A graph of the same forward replays them in one launch, but a graph has one shape,
so a prompt runs at the shortest captured length that holds it, padded after its last token
(`ForwardBatch.valid_tokens`: padding changes no state a later token reads). Only prompts
from position 0 run here: the attention reads the cache up to a start position the graph
fixes. Lengths without a graph (a CPU engine) run the same padded forward eagerly.

The input is one int64 buffer [2 + T]: the slot, the prompt's length, then the padded ids.
"""

from __future__ import annotations

import torch

from dflash_serve.cuda_graphs import StepGraphs
from target_service.model.decoder import Qwen35TextModel
from target_service.model.forward_batch import ForwardBatch
from target_service.model.state import TargetState


def padded_prefill(
    model: Qwen35TextModel,
    state: TargetState,
    tap_layer_ids: tuple[int, ...],
    inputs: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One prompt's prefill from position 0 at the padded length T = inputs' length − 2 →
    (the last real token's logits [vocab] fp32, taps [T, n·hidden] or None, padding rows
    included). Reads only `inputs` on the device, so a graph of it replays."""
    slot, valid, ids = inputs[0:1], inputs[1:2], inputs[2:]
    num_tokens = ids.shape[0]
    batch = ForwardBatch(
        (0,), (0,), num_tokens, False, slot, torch.zeros_like(slot), valid_tokens=valid
    )  # the slot tuple is a placeholder: the layers read `slot`
    hidden, taps = model(ids[None], batch, state, tap_layer_ids)
    last = hidden[0].index_select(0, valid - 1)
    return model.logits(last)[0], None if taps is None else taps[0]


class PrefillGraphs:
    """Captured `padded_prefill` forwards, one per run length."""

    def __init__(
        self,
        model: Qwen35TextModel,
        state: TargetState,
        tap_layer_ids: tuple[int, ...],
        run_tokens: tuple[int, ...],
    ) -> None:
        """Captures immediately; like VerifyGraphs, before any sequence holds state (it
        prefills slot 0, which opening a sequence resets)."""
        self.model = model
        self.state = state
        self.tap_layer_ids = tap_layer_ids
        device = model.embed_tokens.weight.device
        warmup = {}
        for num_tokens in run_tokens:
            inputs = torch.zeros(2 + num_tokens, dtype=torch.int64, device=device)
            inputs[1] = num_tokens
            warmup[num_tokens] = (inputs,)
        self.graphs = StepGraphs(self._forward, warmup)

    def _forward(self, inputs: tuple[torch.Tensor], num_tokens: int):
        return padded_prefill(self.model, self.state, self.tap_layer_ids, inputs[0])

    def replay(self, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`padded_prefill`'s result for host `inputs` of a captured length."""
        return self.graphs.replay(inputs.shape[0] - 2, inputs)
