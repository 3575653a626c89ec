"""Commit the accepted prefix of a verified block and roll back the rest.

Attention needs nothing: keys beyond the committed length are masked and later overwritten.
The GDN conv state is the last k−1 pre-conv inputs of [old conv state ; kept tokens]. The
recurrent state is the block's final state when every token its forward ran is kept
(a block padded to a graph's length never is), else the committed
state advanced over the kept tokens with the block's recorded inputs, by the same
recurrence the verify ran (plain torch `replay_state`, or the Triton kernel on the GPU path),
so the result is bit for bit the state the verify passed through after those tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from target_service.model.causal_conv import conv_state_after
from target_service.model.delta_rule import replay_state
from target_service.model.state import TargetState


def commit_blocks(
    state: TargetState,
    slots: Sequence[int],
    num_kept: Sequence[int],
    recurrence_kernel: Callable | None = None,
) -> None:
    """Keep the first `num_kept[i]` tokens of slot `slots[i]`'s last verified block (every
    GDN layer), for all the slots at once: a batch's commit costs a few launches, not a few
    per sequence.

    recurrence_kernel: `recurrent_gated_delta` when the verify ran it, else None.
    """
    for slot, kept in zip(slots, num_kept, strict=True):
        assert 1 <= kept <= state.block_sizes[slot], (slot, kept, state.block_sizes[slot])
    whole = [i for i, slot in enumerate(slots) if num_kept[i] == state.block_run_sizes[slot]]
    partial = [i for i, slot in enumerate(slots) if num_kept[i] != state.block_run_sizes[slot]]
    # Every index the launches need, in one copy to the device without a stream sync.
    n = len(slots)
    packed = list(slots) + list(num_kept) + [slots[i] for i in whole]
    packed += [slots[i] for i in partial] + [num_kept[i] for i in partial]
    on_device = torch.tensor(packed).to(state.conv_state.device, non_blocking=True)
    index, kept = on_device[:n], on_device[n : 2 * n]
    whole_index = on_device[2 * n : 2 * n + len(whole)]
    partial_index = on_device[2 * n + len(whole) : 2 * n + len(whole) + len(partial)]
    partial_kept = on_device[2 * n + len(whole) + len(partial) :]
    state.conv_state[:, index] = conv_state_after(
        state.conv_state[:, index], state.block_conv_inputs[:, index], kept
    )
    if whole:
        state.recurrent_state[:, whole_index] = state.block_final_state[:, whole_index]
    if partial and recurrence_kernel is None:
        for i in partial:
            _replay_in_torch(state, slots[i], num_kept[i])
    elif partial:
        longest = max(num_kept[i] for i in partial)
        _replay_with_kernel(state, partial_index, partial_kept, longest, recurrence_kernel)
    for slot, kept in zip(slots, num_kept, strict=True):
        state.lengths[slot] += kept
        state.block_sizes[slot] = state.block_run_sizes[slot] = 0


def _replay_in_torch(state: TargetState, slot: int, num_kept: int) -> None:
    for layer in range(state.recurrent_state.shape[0]):
        state.recurrent_state[layer, slot] = replay_state(
            state.recurrent_state[layer, slot],
            state.block_keys[layer, slot, :num_kept],
            state.block_values[layer, slot, :num_kept],
            state.block_decays[layer, slot, :num_kept],
            state.block_betas[layer, slot, :num_kept],
        )


def _replay_with_kernel(
    state: TargetState,
    slots: torch.Tensor,
    num_kept: torch.Tensor,
    longest: int,
    kernel: Callable,
) -> None:
    """One launch for all GDN layers and slots: row l·n + i replays layer l of slots[i] over
    its num_kept[i] tokens (the kernel's per-row count; the per-token arithmetic is the
    same for any count or batch), on pool entry l·S + slots[i]. slots, num_kept: int64 [n]
    on the device; longest: max(num_kept)."""
    num_layers, num_slots = state.recurrent_state.shape[:2]
    pool = state.recurrent_state.view(num_layers * num_slots, *state.recurrent_state.shape[2:])
    layers = torch.arange(num_layers, device=pool.device)
    entries = (layers[:, None] * num_slots + slots).flatten()
    rows = num_layers * slots.shape[0]

    def recorded(tensor: torch.Tensor) -> torch.Tensor:
        return tensor[:, slots, :longest].reshape(rows, longest, *tensor.shape[3:])

    keys = recorded(state.block_keys)
    kernel(
        keys,  # the queries: unused, as no outputs are asked for
        keys,
        recorded(state.block_values),
        recorded(state.block_decays),
        recorded(state.block_betas),
        pool,
        pool,
        entries,
        num_kept.to(torch.int32).repeat(num_layers),
    )
