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

from collections.abc import Callable

import torch

from target_service.model.causal_conv import conv_state_after
from target_service.model.delta_rule import replay_state
from target_service.model.state import TargetState


def commit_block(
    state: TargetState, slot: int, num_kept: int, recurrence_kernel: Callable | None = None
) -> None:
    """Keep the first `num_kept` tokens of the slot's last verified block (every GDN layer).

    recurrence_kernel: `recurrent_gated_delta` when the verify ran it, else None.
    """
    block_size = state.block_sizes[slot]
    assert 1 <= num_kept <= block_size, (num_kept, block_size)
    state.conv_state[:, slot] = conv_state_after(
        state.conv_state[:, slot], state.block_conv_inputs[:, slot], num_kept
    )
    if num_kept == state.block_run_sizes[slot]:
        state.recurrent_state[:, slot] = state.block_final_state[:, slot]
    elif recurrence_kernel is None:
        for layer in range(state.recurrent_state.shape[0]):
            state.recurrent_state[layer, slot] = replay_state(
                state.recurrent_state[layer, slot],
                state.block_keys[layer, slot, :num_kept],
                state.block_values[layer, slot, :num_kept],
                state.block_decays[layer, slot, :num_kept],
                state.block_betas[layer, slot, :num_kept],
            )
    else:
        _replay_with_kernel(state, slot, num_kept, recurrence_kernel)
    state.lengths[slot] += num_kept
    state.block_sizes[slot] = state.block_run_sizes[slot] = 0


def _replay_with_kernel(state: TargetState, slot: int, num_kept: int, kernel: Callable) -> None:
    """One launch for all GDN layers: layer l is row l, its state is pool entry l·S + slot."""
    num_layers, num_slots = state.recurrent_state.shape[:2]
    pool = state.recurrent_state.view(num_layers * num_slots, *state.recurrent_state.shape[2:])
    entries = torch.arange(num_layers, device=pool.device) * num_slots + slot
    keys = state.block_keys[:, slot, :num_kept].contiguous()
    kernel(
        keys,  # the queries: unused, as no outputs are asked for
        keys,
        state.block_values[:, slot, :num_kept].contiguous(),
        state.block_decays[:, slot, :num_kept].contiguous(),
        state.block_betas[:, slot, :num_kept].contiguous(),
        pool,
        pool,
        entries,
    )
