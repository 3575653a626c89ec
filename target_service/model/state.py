"""Preallocated per-sequence state of the target, addressed by slot.

Per slot: the attention KV cache, and for every GDN layer the conv state, the committed
recurrent state and one scratch recurrent state (the state after the whole last block).
A verify never touches the committed state; `commit(n)` either adopts the scratch state
(every block token kept) or replays the recurrence over the n kept tokens from the committed
state using the block's cached per-token inputs (with commit graphs, always the replay: the
same bits). That is two recurrent states per sequence, never one per draft position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_serve.qwen35_config import Qwen35TextConfig

MAX_BLOCK_TOKENS = 16


@dataclass(frozen=True)
class StateShape:
    """Sizes of the preallocated state; fixed at start-up."""

    max_slots: int
    max_len: int
    max_block_tokens: int = MAX_BLOCK_TOKENS


class TargetState:
    """All tensors of all slots; layers index them by (layer ordinal, slot)."""

    def __init__(
        self,
        config: Qwen35TextConfig,
        shape: StateShape,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.config = config
        self.shape = shape
        num_attn = len(config.attention_layer_ids)
        num_gdn = len(config.gdn_layer_ids)
        slots, block = shape.max_slots, shape.max_block_tokens
        heads_k, heads_v, dk, dv = (
            config.linear_num_key_heads,
            config.linear_num_value_heads,
            config.linear_key_head_dim,
            config.linear_value_head_dim,
        )
        # Room for one block past max_len: a block padded to a captured graph's length
        # writes (never-read) keys there.
        kv_len = shape.max_len + shape.max_block_tokens
        kv = (num_attn, slots, kv_len, config.num_key_value_heads, config.head_dim)
        self.key_cache = torch.zeros(kv, dtype=dtype, device=device)
        self.value_cache = torch.zeros(kv, dtype=dtype, device=device)
        conv = (num_gdn, slots, config.gdn_conv_dim, config.linear_conv_kernel_dim - 1)
        self.conv_state = torch.zeros(conv, dtype=dtype, device=device)
        recurrent = (num_gdn, slots, heads_v, dk, dv)
        self.recurrent_state = torch.zeros(recurrent, dtype=torch.float32, device=device)
        self.block_final_state = torch.zeros(recurrent, dtype=torch.float32, device=device)
        # The last block's per-token GDN inputs, kept to replay the accepted prefix.
        self.block_conv_inputs = torch.zeros(
            (num_gdn, slots, block, config.gdn_conv_dim), dtype=dtype, device=device
        )
        f32 = dict(dtype=torch.float32, device=device)
        # Keys before l2 normalisation (the recurrence normalises them, in forward and replay).
        self.block_keys = torch.zeros((num_gdn, slots, block, heads_k, dk), **f32)
        self.block_values = torch.zeros((num_gdn, slots, block, heads_v, dv), **f32)
        self.block_decays = torch.zeros((num_gdn, slots, block, heads_v), **f32)
        self.block_betas = torch.zeros((num_gdn, slots, block, heads_v), **f32)
        self.lengths = [0] * slots
        self.block_sizes = [0] * slots  # tokens of the last verified block (keepable)
        # Tokens its forward ran: more than block_sizes when padded to a captured graph's
        # length; block_final_state is the state after all of them.
        self.block_run_sizes = [0] * slots

    def reset_slot(self, slot: int) -> None:
        """Forget a sequence: zero its GDN state (its KV cache is masked by length)."""
        self.conv_state[:, slot].zero_()
        self.recurrent_state[:, slot].zero_()
        self.lengths[slot] = 0
        self.block_sizes[slot] = 0
        self.block_run_sizes[slot] = 0

    def bytes_per_sequence(self) -> dict[str, int]:
        """State bytes one slot owns, by kind; KV is per token of capacity."""
        per_slot = {
            "recurrent_states": (
                self.recurrent_state[:, 0].nbytes + self.block_final_state[:, 0].nbytes
            ),
            "conv_state": self.conv_state[:, 0].nbytes,
            "block_inputs": sum(
                t[:, 0].nbytes
                for t in (
                    self.block_conv_inputs,
                    self.block_keys,
                    self.block_values,
                    self.block_decays,
                    self.block_betas,
                )
            ),
            "kv_cache": self.key_cache[:, 0].nbytes + self.value_cache[:, 0].nbytes,
        }
        return per_slot
