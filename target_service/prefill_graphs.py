"""Prompts from position 0 prefilled at a few fixed lengths, padded, as CUDA graphs.

An eager prefill forward is some 900 kernel launches: on an H200 ~50 ms of host time, which
the GPU waits for on prompts below a few thousand tokens (a 512-token prefill's GPU work is
~14 ms). A graph of the same forward replays them in one launch, but a graph has one shape,
so a prompt runs at the shortest captured length that holds it, padded after its last token
(`ForwardBatch.valid_tokens`: padding changes no state a later token reads). Only prompts
from position 0 run here: the attention reads the cache up to a start position the graph
fixes. Shapes without a graph (a CPU engine) run the same padded forward eagerly.

Several prompts of one run length may share a forward, one row each (concurrent sessions
starting together): the engine batches them only where every kernel the forward runs gives a
row the same bits whatever the other rows are (`TargetEngine.prefill_group_size`): run
lengths the row kernels take alone, which then take the whole forward
(`Qwen35TextModel.row_kernels_for_prompts`).

The input is one int64 buffer [2 + T, B], as the verify graphs': the prompts' slots, their
lengths, then their padded ids by position.
"""

from __future__ import annotations

import torch

from dflash_serve.cuda_graphs import StepGraphs
from target_service.model.decoder import Qwen35TextModel
from target_service.model.forward_batch import ForwardBatch, ints_on_device
from target_service.model.state import TargetState


def padded_prefill(
    model: Qwen35TextModel,
    state: TargetState,
    tap_layer_ids: tuple[int, ...],
    inputs: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """B prompts' prefill from position 0 at the padded length T = inputs' length − 2 → (each
    prompt's last real token's logits [B, vocab] fp32, taps [B, T, n·hidden] or None, padding
    rows included). Reads only `inputs` on the device, so a graph of it replays."""
    slots, valid, ids = inputs[0], inputs[1], inputs[2:].t()
    num_prompts, num_tokens = ids.shape
    placeholder = (0,) * num_prompts  # the layers read the tensors, not the tuples
    batch = ForwardBatch(
        placeholder,
        placeholder,
        num_tokens,
        is_verify=False,
        slot_ids=slots,
        start_ids=torch.zeros_like(slots),
        valid_tokens=valid,
    )
    with model.row_kernels_for_prompts(num_prompts, num_tokens):
        hidden, taps = model(ids, batch, state, tap_layer_ids)
        rows = torch.arange(num_prompts, device=hidden.device)
        return model.logits(hidden[rows, valid - 1]), taps


def run_padded_prefill(
    model: Qwen35TextModel,
    state: TargetState,
    tap_layer_ids: tuple[int, ...],
    graphs: PrefillGraphs | None,
    slots: list[int],
    prompts: list[list[int]],
    run_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`padded_prefill` of these prompts (from position 0) at `run_tokens`, each padded with
    its last id: the graph of (len(prompts), run_tokens) where `graphs` has it, else eagerly."""
    padded = [ids + [ids[-1]] * (run_tokens - len(ids)) for ids in prompts]
    columns = [slots, [len(ids) for ids in prompts], *zip(*padded, strict=True)]
    if graphs is not None and graphs.has(len(slots), run_tokens):
        return graphs.replay(torch.tensor(columns))
    on_device = ints_on_device(columns, model.embed_tokens.weight.device)
    return padded_prefill(model, state, tap_layer_ids, on_device)


class PrefillGraphs:
    """Captured `padded_prefill` forwards, one per (prompts, run length)."""

    def __init__(
        self,
        model: Qwen35TextModel,
        state: TargetState,
        tap_layer_ids: tuple[int, ...],
        shapes: tuple[tuple[int, int], ...],
    ) -> None:
        """Captures immediately; like VerifyGraphs, before any sequence holds state (the
        forward of B prompts prefills slots 0..B-1, which opening a sequence resets)."""
        self.model = model
        self.state = state
        self.tap_layer_ids = tap_layer_ids
        device = model.embed_tokens.weight.device
        warmup = {}
        for num_prompts, num_tokens in shapes:
            inputs = torch.zeros((2 + num_tokens, num_prompts), dtype=torch.int64, device=device)
            inputs[0] = torch.arange(num_prompts, device=device)
            inputs[1] = num_tokens
            warmup[(num_prompts, num_tokens)] = (inputs,)
        self.graphs = StepGraphs(self._forward, warmup)

    def _forward(self, inputs: tuple[torch.Tensor], shape: tuple[int, int]):
        return padded_prefill(self.model, self.state, self.tap_layer_ids, inputs[0])

    def has(self, num_prompts: int, num_tokens: int) -> bool:
        return self.graphs.has((num_prompts, num_tokens))

    def replay(self, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`padded_prefill`'s result for host `inputs` of a captured shape."""
        length, num_prompts = inputs.shape
        return self.graphs.replay((num_prompts, length - 2), inputs)
