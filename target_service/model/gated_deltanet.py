"""Gated DeltaNet (linear attention) layer of Qwen3.5, with recoverable state.

Attribute names match the checkpoint (`layers.N.linear_attn.*`). Prefill runs the chunked
plain-torch recurrence; verify/decode runs the token-by-token recurrence, as plain torch or,
after `use_gpu_kernels`, as one Triton kernel that reads and writes the state pools by slot.
On the kernel path prefill also takes the fused input kernel (conv, SiLU, gates) and
fla-core's chunked rule where it is installed.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_serve.layers.activations import sigmoid, silu, softplus
from dflash_serve.layers.linear import Linear, RowKernelGroup
from dflash_serve.layers.norms import GatedRMSNorm
from dflash_serve.qwen35_config import Qwen35TextConfig
from target_service.kernels.chunked_prefill import chunked_prefill
from target_service.model.causal_conv import (
    causal_conv_with_state,
    conv_state_after,
    conv_states_after,
)
from target_service.model.chunked_delta_rule import chunked_gated_delta_rule
from target_service.model.delta_rule import expand_key_heads, gated_delta_rule, l2_normalize
from target_service.model.forward_batch import ForwardBatch
from target_service.model.state import TargetState

# b and a in `_projections`' order, which the input kernel may take as split-K partial sums.
# Not the conv inputs: the conv's four taps would read each of their partials four times,
# slower at 8 verify blocks than the sum's launch (H200, 2026-12-04).
GATE_PROJECTIONS = (2, 3)


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
        self.recurrence_kernel = None  # these five are set by use_gpu_kernels / fuse_row_kernels
        self.inputs_kernel = None
        self.prefill_inputs_kernel = None
        self.chunk_rule = None
        self.in_projs: RowKernelGroup | None = None

    def use_gpu_kernels(self) -> None:
        """Run verify/decode on Triton kernels (imported here: a GPU dependency), and prefill
        on fla-core's chunked kernels where it is installed."""
        from target_service.kernels.chunked_prefill import load_chunk_rule
        from target_service.kernels.gated_delta_recurrence import recurrent_gated_delta
        from target_service.kernels.gdn_inputs import (
            prepare_gdn_inputs,
            prepare_gdn_prefill_inputs,
        )

        self.recurrence_kernel = recurrent_gated_delta
        self.inputs_kernel = prepare_gdn_inputs
        self.prefill_inputs_kernel = prepare_gdn_prefill_inputs
        self.chunk_rule = load_chunk_rule()

    def fuse_row_kernels(self) -> None:
        """The four input projections as one kernel matmul per weight kind."""
        projections = [self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a]
        self.in_projs = RowKernelGroup(projections)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, state: TargetState) -> torch.Tensor:
        """x [B, T, hidden] → [B, T, hidden]; reads and writes this layer's state slots."""
        if self.recurrence_kernel is not None:
            if batch.is_verify:
                return self._verify_on_kernels(x, batch, state)
            return self._prefill_on_kernels(x, batch, state)
        num_tokens = x.shape[1]
        slots = batch.slot_index(x.device)
        conv_inputs = self.in_proj_qkv(x)
        conv_out, conv_state = causal_conv_with_state(
            conv_inputs, state.conv_state[self.gdn_index, slots], self.conv1d.weight[:, 0, :]
        )
        q, k, v = self._heads(silu(conv_out))
        beta = sigmoid(self.in_proj_b(x)).float()
        a = self.in_proj_a(x).float()
        decay = -self.A_log.float().exp() * softplus(a + self.dt_bias.float())
        if not batch.is_verify:
            real = batch.real_rows(x.device)
            if real is not None:  # padding: no decay, no update; history from real tokens
                decay, beta = decay * real[..., None], beta * real[..., None]
                conv_state = conv_states_after(
                    state.conv_state[self.gdn_index, slots], conv_inputs, batch.valid_tokens
                )
            out = self._prefill(q, k, v, decay, beta, slots, state)
            state.conv_state[self.gdn_index, slots] = conv_state.to(state.conv_state.dtype)
        else:
            out = self._verify_reference(q, k, v, decay, beta, slots, state)
            self._record_block(state, slots, num_tokens, conv_inputs, k, v, decay, beta)
        return self._gated_output(out, self.in_proj_z(x))

    def _normalized_heads(self, q, k):
        q = l2_normalize(q) * self.key_head_dim**-0.5
        k = l2_normalize(k)
        return expand_key_heads(q, self.num_value_heads), expand_key_heads(k, self.num_value_heads)

    def _prefill(self, q, k, v, decay, beta, slots, state: TargetState) -> torch.Tensor:
        """Committed as it goes, in chunks (prefill is shared by both decoding modes, so it
        need not be row-independent)."""
        q, k = self._normalized_heads(q, k)
        initial = state.recurrent_state[self.gdn_index, slots]
        out, final = chunked_gated_delta_rule(q, k, v.float(), decay, beta, initial)
        state.recurrent_state[self.gdn_index, slots] = final
        return out

    def _verify_reference(self, q, k, v, decay, beta, slots, state: TargetState) -> torch.Tensor:
        """Token by token, so the state after n tokens is the same for any block length."""
        q, k = self._normalized_heads(q, k)
        initial = state.recurrent_state[self.gdn_index, slots]
        out, final = gated_delta_rule(q, k, v.float(), decay, beta, initial)
        state.block_final_state[self.gdn_index, slots] = final
        return out

    def _verify_on_kernels(self, x, batch: ForwardBatch, state: TargetState) -> torch.Tensor:
        """The verify step as three kernels between the matmuls: inputs (conv, SiLU, gates,
        block record), recurrence, gated norm. Reads only the batch's device tensors. Where
        the b and a projections are a matmul of their own that splits K (4-bit layers read
        packed; they stay bf16), the input kernel adds its partial sums as the sum kernel
        would: one launch fewer per layer."""
        slots, layer = batch.slot_index(x.device), self.gdn_index
        conv_inputs, z, b, a = self._projections(x, keep_splits_of=GATE_PROJECTIONS)
        conv_out, gates = self._kernel_outputs(conv_inputs)
        key_dim = self.split_sizes[0]
        self.inputs_kernel(
            conv_inputs, a, b, state.conv_state[layer], self.conv1d.weight[:, 0, :],
            self.A_log, self.dt_bias, slots, key_dim, conv_out, gates[0], gates[1],
            state.block_conv_inputs[layer], state.block_keys[layer].flatten(2),
            state.block_values[layer].flatten(2), state.block_decays[layer],
            state.block_betas[layer],
        )  # fmt: skip
        q, k, v = self._heads(conv_out)
        # In the activations' dtype: the kernel rounds each output as the cast after it would.
        out = torch.empty(v.shape, dtype=z.dtype, device=x.device)
        self.recurrence_kernel(
            q, k, v, gates[0], gates[1], state.recurrent_state[layer],
            state.block_final_state[layer], slots, out=out,
        )  # fmt: skip
        return self._gated_output(out, z)

    def _prefill_on_kernels(self, x, batch: ForwardBatch, state: TargetState) -> torch.Tensor:
        """Prefill on the kernel path, committed as it goes: the verify's input kernel without
        its block record (one pass over the chunk where plain torch made some 20), then
        fla-core's chunked rule if installed, else the verify's recurrence token by token,
        both in place in the state pool."""
        slots, layer = batch.slot_index(x.device), self.gdn_index
        conv_inputs, z, b, a = self._projections(x)
        conv_out, gates = self._kernel_outputs(conv_inputs)
        conv_states = state.conv_state[layer]
        self.prefill_inputs_kernel(
            conv_inputs, a, b, conv_states, self.conv1d.weight[:, 0, :], self.A_log,
            self.dt_bias, slots, conv_out, gates[0], gates[1],
        )  # fmt: skip
        real = batch.real_rows(x.device)
        if real is None:
            history = conv_state_after(conv_states[slots], conv_inputs, conv_inputs.shape[1])
        else:  # padding (a prefill graph's): no decay, no update; history from real tokens
            gates.mul_(real[None, :, :, None])
            history = conv_states_after(conv_states[slots], conv_inputs, batch.valid_tokens)
        conv_states[slots] = history.to(conv_states.dtype)  # after the kernel read the old one
        q, k, v = self._heads(conv_out)
        pool = state.recurrent_state[layer]
        if self.chunk_rule is not None:
            out = chunked_prefill(self.chunk_rule, q, k, v, gates[0], gates[1], pool, slots)
        else:
            out = torch.empty(v.shape, dtype=z.dtype, device=x.device)
            self.recurrence_kernel(q, k, v, gates[0], gates[1], pool, pool, slots, out=out)
        return self._gated_output(out, z)

    def _projections(self, x: torch.Tensor, keep_splits_of: tuple[int, ...] = ()) -> tuple:
        """(conv_inputs, z, b, a): one kernel matmul per weight kind where the row kernels
        take x's rows (those of keep_splits_of possibly as `SplitSums`), else the four
        linears."""
        if self.in_projs is not None and self.in_projs.accepts(x):
            return tuple(self.in_projs(x, keep_splits_of))
        return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)

    def _kernel_outputs(self, conv_inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What the input kernels write: conv_out (conv_inputs' shape and dtype) and the gates
        [2, B, T, Hv] fp32 (decay, beta)."""
        num_seqs, num_tokens, _ = conv_inputs.shape
        conv_out = torch.empty(
            conv_inputs.shape, dtype=conv_inputs.dtype, device=conv_inputs.device
        )
        gates = torch.empty(
            (2, num_seqs, num_tokens, self.num_value_heads), device=conv_inputs.device
        )
        return conv_out, gates

    def _heads(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k [B, T, Hk, Dk] and v [B, T, Hv, Dv]: views of conv_out's channels."""
        num_seqs, num_tokens, _ = conv_out.shape
        q, k, v = torch.split(conv_out, self.split_sizes, dim=-1)
        key_heads = (num_seqs, num_tokens, -1, self.key_head_dim)
        values = (num_seqs, num_tokens, -1, self.value_head_dim)
        return q.view(key_heads), k.view(key_heads), v.view(values)

    def _gated_output(self, out: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The recurrence's output [B, T, Hv, Dv] → gated norm (gate z) → out_proj."""
        num_seqs, num_tokens = out.shape[:2]
        gate = z.reshape(num_seqs, num_tokens, -1, self.value_head_dim)
        out = self.norm(out.to(z.dtype), gate)
        return self.out_proj(out.reshape(num_seqs, num_tokens, -1))

    def _record_block(self, state, slots, num_tokens, conv_inputs, raw_keys, v, decay, beta):
        """Keep what commit(n) needs besides the final state: the block's per-token inputs."""
        layer = self.gdn_index
        state.block_conv_inputs[layer, slots, :num_tokens] = conv_inputs
        state.block_keys[layer, slots, :num_tokens] = raw_keys.float()
        state.block_values[layer, slots, :num_tokens] = v.float()
        state.block_decays[layer, slots, :num_tokens] = decay
        state.block_betas[layer, slots, :num_tokens] = beta
