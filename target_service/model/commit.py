"""Commit the accepted prefix of a verified block and roll back the rest.

Attention needs nothing: keys beyond the committed length are masked and later overwritten.
The GDN conv state is the last k−1 pre-conv inputs of [old conv state ; kept tokens]. The
recurrent state is the block's final state when every token is kept, else the committed
state advanced over the kept tokens with the block's recorded inputs (`replay_state`).
"""

from __future__ import annotations

from target_service.model.causal_conv import conv_state_after
from target_service.model.delta_rule import replay_state
from target_service.model.state import TargetState


def commit_block(state: TargetState, slot: int, num_kept: int) -> None:
    """Keep the first `num_kept` tokens of the slot's last verified block."""
    block_size = state.block_sizes[slot]
    assert 1 <= num_kept <= block_size, (num_kept, block_size)
    for layer in range(state.conv_state.shape[0]):
        state.conv_state[layer, slot] = conv_state_after(
            state.conv_state[layer, slot], state.block_conv_inputs[layer, slot], num_kept
        )
        if num_kept == block_size:
            state.recurrent_state[layer, slot] = state.block_final_state[layer, slot]
        else:
            state.recurrent_state[layer, slot] = replay_state(
                state.recurrent_state[layer, slot],
                state.block_keys[layer, slot, :num_kept],
                state.block_values[layer, slot, :num_kept],
                state.block_decays[layer, slot, :num_kept],
                state.block_betas[layer, slot, :num_kept],
            )
    state.lengths[slot] += num_kept
    state.block_sizes[slot] = 0
