"""Commit the accepted prefix of a verified block and roll back the rest.

Attention needs nothing: keys beyond the committed length are masked and later overwritten.
The GDN conv state is the last k−1 pre-conv inputs of [old conv state ; kept tokens]. The
recurrent state is the block's final state when every token its forward ran is kept
(a block padded to a graph's length or to the batch's longest block never is), else the committed
state advanced over the kept tokens with the block's recorded inputs, by the same
recurrence the verify ran (plain torch `replay_state`, or the Triton kernel on the GPU path),
so the result is bit for bit the state the verify passed through after those tokens. The
capturable commit (`commit_on_device`, for `CommitGraphs`) replays whole blocks too, which
the kernel makes the same final state bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from target_service.model.causal_conv import conv_state_after, conv_states_after
from target_service.model.delta_rule import replay_state
from target_service.model.forward_batch import ints_on_device
from target_service.model.state import TargetState


def commit_blocks(
    state: TargetState,
    slots: Sequence[int],
    num_kept: Sequence[int],
    recurrence_kernel: Callable | None = None,
) -> None:
    """Keep the first `num_kept[i]` tokens of slot `slots[i]`'s last verified block (every
    GDN layer), for all the slots at once.

    A batch costs a few launches, not a few per sequence (gathers by slot, one recurrence
    launch for every replayed prefix); one slot takes views of its own rows instead, which
    is cheaper than gathering (measured at batch 1 on the H200). recurrence_kernel:
    `recurrent_gated_delta` when the verify ran it, else None.
    """
    assert len(set(slots)) == len(slots), slots  # index_copy_ with repeats is undefined
    for slot, kept in zip(slots, num_kept, strict=True):
        assert 1 <= kept <= state.block_sizes[slot], (slot, kept, state.block_sizes[slot])
    if len(slots) == 1:
        _commit_one(state, slots[0], num_kept[0], recurrence_kernel)
    else:
        _commit_batch(state, slots, num_kept, recurrence_kernel)
    record_commits(state, slots, num_kept)


def record_commits(state: TargetState, slots: Sequence[int], num_kept: Sequence[int]) -> None:
    """The host's side of a commit: lengths grow by the kept tokens, no block is pending."""
    for slot, kept in zip(slots, num_kept, strict=True):
        state.lengths[slot] += kept
        state.block_sizes[slot] = state.block_run_sizes[slot] = 0


def commit_on_device(
    state: TargetState, slots: torch.Tensor, num_kept: torch.Tensor, recurrence_kernel: Callable
) -> None:
    """`commit_blocks`' GDN state changes with the slots and counts read from the device
    (int64 [B] each), in launches whose shapes depend on B alone: capturable in a CUDA graph
    (`CommitGraphs`), where the eager commit's ~0.7 ms of host time per step goes (H100,
    2026-12-05, batch 1). The host's side is `record_commits`.

    Every slot's recurrent state is replayed over its kept tokens, a whole block's too: the
    kernel's state after n of a block's recorded tokens is bit for bit the state its verify
    passed through there, n = all of them included (`recurrent_gated_delta`), so replaying
    a whole block gives the final state `commit_blocks` copies. The replay reads all
    `max_block_tokens` recorded rows of each slot and applies its own count."""
    num_layers, num_slots = state.recurrent_state.shape[:2]
    inputs = state.block_conv_inputs.index_select(1, slots)
    state.conv_state.index_copy_(
        1, slots, conv_states_after(state.conv_state.index_select(1, slots), inputs, num_kept)
    )
    layers = torch.arange(num_layers, device=slots.device)
    entries = (layers[:, None] * num_slots + slots[None, :]).flatten()  # row l·B + i
    counts = num_kept.to(torch.int32).repeat(num_layers)
    recorded = [tensor.index_select(1, slots).flatten(0, 1) for tensor in _recorded_inputs(state)]
    _replay_with_kernel(recurrence_kernel, state, recorded, entries, counts)


def _commit_one(state: TargetState, slot: int, num_kept: int, kernel: Callable | None) -> None:
    state.conv_state[:, slot] = conv_state_after(
        state.conv_state[:, slot], state.block_conv_inputs[:, slot], num_kept
    )
    if num_kept == state.block_run_sizes[slot]:
        state.recurrent_state[:, slot] = state.block_final_state[:, slot]
    elif kernel is None:
        _replay_in_torch(state, slot, num_kept)
    else:
        num_layers, num_slots = state.recurrent_state.shape[:2]
        entries = torch.arange(num_layers, device=state.recurrent_state.device) * num_slots + slot
        _replay_with_kernel(
            kernel,
            state,
            [tensor[:, slot, :num_kept].contiguous() for tensor in _recorded_inputs(state)],
            entries,
        )


def _commit_batch(
    state: TargetState, slots: Sequence[int], num_kept: Sequence[int], kernel: Callable | None
) -> None:
    whole = [i for i, slot in enumerate(slots) if num_kept[i] == state.block_run_sizes[slot]]
    partial = [i for i, slot in enumerate(slots) if num_kept[i] != state.block_run_sizes[slot]]
    # Every index the launches need, in one copy to the device without a stream sync.
    num_layers, num_slots = state.recurrent_state.shape[:2]
    partial_slots = [slots[i] for i in partial]
    entries = [layer * num_slots + slot for layer in range(num_layers) for slot in partial_slots]
    counts = [num_kept[i] for i in partial] * num_layers
    packed = [*slots, *num_kept, *(slots[i] for i in whole), *partial_slots, *entries, *counts]
    on_device = ints_on_device(packed, state.conv_state.device)
    index, kept, whole_index, partial_index, entries_index, counts_index = on_device.split(
        [len(slots), len(slots), len(whole), len(partial), len(entries), len(counts)]
    )
    inputs = state.block_conv_inputs.index_select(1, index)
    state.conv_state.index_copy_(
        1, index, conv_states_after(state.conv_state.index_select(1, index), inputs, kept)
    )
    if whole:
        final = state.block_final_state.index_select(1, whole_index)
        state.recurrent_state.index_copy_(1, whole_index, final)
    if partial and kernel is None:
        for i in partial:
            _replay_in_torch(state, slots[i], num_kept[i])
    elif partial:
        longest = max(num_kept[i] for i in partial)

        def picked(tensor: torch.Tensor) -> torch.Tensor:
            rows = tensor[:, :, :longest].index_select(1, partial_index)
            return rows.view(len(entries), longest, *tensor.shape[3:])

        # Row l·n + i replays layer l of partial slot i over its own count (the kernel's
        # per-row count; the per-token arithmetic is the same for any count or batch).
        inputs = [picked(tensor) for tensor in _recorded_inputs(state)]
        _replay_with_kernel(kernel, state, inputs, entries_index, counts_index.to(torch.int32))


def _recorded_inputs(state: TargetState) -> tuple[torch.Tensor, ...]:
    """The last blocks' per-token GDN inputs [layers, slots, T, ...]: keys, values, decays,
    betas."""
    return state.block_keys, state.block_values, state.block_decays, state.block_betas


def _replay_with_kernel(
    kernel: Callable,
    state: TargetState,
    inputs: list[torch.Tensor],
    entries: torch.Tensor,
    counts: torch.Tensor | None = None,
) -> None:
    """Advance recurrent-state pool entries (layer l of slot s is entry l·S + s) over
    recorded inputs [rows, T, ...] (keys, values, decays, betas), row r's first counts[r]
    tokens (None: all), in place."""
    num_layers, num_slots = state.recurrent_state.shape[:2]
    pool = state.recurrent_state.view(num_layers * num_slots, *state.recurrent_state.shape[2:])
    keys, values, decays, betas = inputs
    # The keys stand in for the queries: unused, as no outputs are asked for.
    kernel(keys, keys, values, decays, betas, pool, pool, entries, counts)


def _replay_in_torch(state: TargetState, slot: int, num_kept: int) -> None:
    for layer in range(state.recurrent_state.shape[0]):
        state.recurrent_state[layer, slot] = replay_state(
            state.recurrent_state[layer, slot],
            state.block_keys[layer, slot, :num_kept],
            state.block_values[layer, slot, :num_kept],
            state.block_decays[layer, slot, :num_kept],
            state.block_betas[layer, slot, :num_kept],
        )
