"""Gated DeltaNet (linear attention) layer of Qwen3.5, with recoverable state.

Attribute names match the checkpoint (`layers.N.linear_attn.*`).
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_serve.layers.activations import sigmoid, silu, softplus
from dflash_serve.layers.linear import Linear
from dflash_serve.layers.norms import GatedRMSNorm
from dflash_serve.qwen35_config import Qwen35TextConfig
from target_service.model.causal_conv import causal_conv_with_state
from target_service.model.chunked_delta_rule import chunked_gated_delta_rule
from target_service.model.delta_rule import expand_key_heads, gated_delta_rule
from target_service.model.forward_batch import ForwardBatch
from target_service.model.state import TargetState

L2_NORM_EPS = 1e-6


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """x · rsqrt(Σx² + eps) over the last dim, in fp32 (as fla and transformers do)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_NORM_EPS)


class GatedDeltaNet(nn.Module):
    """in_proj → causal conv + SiLU → gated delta rule → gated RMSNorm → out_proj."""

    def __init__(self, config: Qwen35TextConfig, gdn_index: int) -> None:
        super().__init__()
        self.gdn_index = gdn_index
        self.num_key_heads = config.linear_num_key_heads
        self.num_value_heads = config.linear_num_value_heads
        self.key_head_dim = config.linear_key_head_dim
        self.value_head_dim = config.linear_value_head_dim
        key_dim, value_dim = config.gdn_key_dim, config.gdn_value_dim
        self.split_sizes = (key_dim, key_dim, value_dim)
        hidden = config.hidden_size
        self.in_proj_qkv = Linear(hidden, config.gdn_conv_dim)
        self.in_proj_z = Linear(hidden, value_dim)
        self.in_proj_a = Linear(hidden, self.num_value_heads)
        self.in_proj_b = Linear(hidden, self.num_value_heads)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(
            torch.zeros(config.gdn_conv_dim, 1, config.linear_conv_kernel_dim), requires_grad=False
        )
        self.A_log = nn.Parameter(torch.zeros(self.num_value_heads), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_value_heads), requires_grad=False)
        self.norm = GatedRMSNorm(self.value_head_dim, config.rms_norm_eps)
        self.out_proj = Linear(value_dim, hidden)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, state: TargetState) -> torch.Tensor:
        """x [B, T, hidden] → [B, T, hidden]; reads and writes this layer's state slots."""
        num_seqs, num_tokens, _ = x.shape
        slots = batch.slot_index(x.device)
        conv_inputs = self.in_proj_qkv(x)
        conv_out, conv_state = causal_conv_with_state(
            conv_inputs, state.conv_state[self.gdn_index, slots], self.conv1d.weight[:, 0, :]
        )
        q, k, v = torch.split(silu(conv_out), self.split_sizes, dim=-1)
        heads = (num_seqs, num_tokens, -1, self.key_head_dim)
        q = l2_normalize(q.reshape(heads)) * self.key_head_dim**-0.5
        k = l2_normalize(k.reshape(heads))
        q = expand_key_heads(q, self.num_value_heads)
        k = expand_key_heads(k, self.num_value_heads)
        v = v.reshape(num_seqs, num_tokens, -1, self.value_head_dim).float()
        beta = sigmoid(self.in_proj_b(x)).float()
        a = self.in_proj_a(x).float()
        decay = -self.A_log.float().exp() * softplus(a + self.dt_bias.float())
        initial = state.recurrent_state[self.gdn_index, slots]
        # Verify/decode token by token (row-independent); prefill in chunks (fast).
        rule = gated_delta_rule if batch.is_verify else chunked_gated_delta_rule
        out, final = rule(q, k, v, decay, beta, initial)
        if batch.is_verify:
            self._record_block(state, slots, num_tokens, conv_inputs, k, v, decay, beta, final)
        else:
            state.recurrent_state[self.gdn_index, slots] = final
            # (under autocast, training, activations are bf16 while the state is fp32)
            state.conv_state[self.gdn_index, slots] = conv_state.to(state.conv_state.dtype)
        z = self.in_proj_z(x).reshape(num_seqs, num_tokens, -1, self.value_head_dim)
        out = self.norm(out.to(x.dtype), z)
        return self.out_proj(out.reshape(num_seqs, num_tokens, -1))

    def _record_block(self, state, slots, num_tokens, conv_inputs, k, v, decay, beta, final):
        """Keep what commit(n) needs: the final state and the block's per-token inputs."""
        layer = self.gdn_index
        state.block_final_state[layer, slots] = final
        state.block_conv_inputs[layer, slots, :num_tokens] = conv_inputs
        state.block_keys[layer, slots, :num_tokens] = k
        state.block_values[layer, slots, :num_tokens] = v
        state.block_decays[layer, slots, :num_tokens] = decay
        state.block_betas[layer, slots, :num_tokens] = beta
