"""Full (softmax) attention layer of Qwen3.5: gated output, q/k norms, partial RoPE, GQA.

Attribute names match the checkpoint (`layers.N.self_attn.*`).
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_serve.layers.activations import sigmoid
from dflash_serve.layers.attention import attend_causal, attend_each_query
from dflash_serve.layers.linear import Linear, RowKernelGroup
from dflash_serve.layers.norms import RMSNorm
from dflash_serve.qwen35_config import Qwen35TextConfig
from target_service.model.forward_batch import ForwardBatch
from target_service.model.state import TargetState


class GatedAttention(nn.Module):
    """q_proj yields a query and a sigmoid gate per head; output = o_proj(attn · σ(gate))."""

    def __init__(self, config: Qwen35TextConfig, attn_index: int) -> None:
        super().__init__()
        self.attn_index = attn_index
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        hidden = config.hidden_size
        self.q_proj = Linear(hidden, self.num_heads * self.head_dim * 2)
        self.k_proj = Linear(hidden, self.num_kv_heads * self.head_dim)
        self.v_proj = Linear(hidden, self.num_kv_heads * self.head_dim)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, zero_centred=True)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, zero_centred=True)
        self.attention_kernel = None  # set by use_gpu_kernels
        self.qkv_projs: RowKernelGroup | None = None  # set by fuse_row_kernels

    def use_gpu_kernels(self) -> None:
        """Verify/decode attention as the Triton kernel (imported here: a GPU dependency)."""
        from dflash_serve.kernels.block_attention import block_attention

        self.attention_kernel = block_attention

    def fuse_row_kernels(self) -> None:
        """q, k and v projections as one kernel matmul per weight kind."""
        self.qkv_projs = RowKernelGroup([self.q_proj, self.k_proj, self.v_proj])

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        state: TargetState,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        if self._verifies_fused(x, batch, state):
            return self.o_proj(self._verify_fused(x, batch, state, cos_sin))
        projected_q, attn = self._project_and_attend(x, batch, state, cos_sin)
        return self.o_proj(attn * sigmoid(self._gates(projected_q).reshape(attn.shape)))

    def _gates(self, projected_q: torch.Tensor) -> torch.Tensor:
        """The output gates [B, T, heads, head_dim] in the query-and-gate projection (a view)."""
        num_seqs, num_tokens, _ = projected_q.shape
        per_head = projected_q.reshape(num_seqs, num_tokens, self.num_heads, 2 * self.head_dim)
        return per_head[..., self.head_dim :]

    def _project_and_attend(self, x, batch: ForwardBatch, state: TargetState, cos_sin):
        """The projections, the q/k norms and rotations, then attention by the batch's kind →
        (the query-and-gate projection [B, T, heads·2·head_dim], the attention output
        [B, T, heads·head_dim])."""
        num_seqs, num_tokens, _ = x.shape
        if self.qkv_projs is not None and self.qkv_projs.accepts(x):
            projected_q, projected_k, projected_v = self.qkv_projs(x)
        else:
            projected_q, projected_k, projected_v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        per_head = projected_q.reshape(num_seqs, num_tokens, self.num_heads, 2 * self.head_dim)
        kv_shape = (num_seqs, num_tokens, self.num_kv_heads, self.head_dim)
        q = self.q_norm.norm_and_rotate(per_head[..., : self.head_dim], cos_sin)
        k = self.k_norm.norm_and_rotate(projected_k.reshape(kv_shape), cos_sin)
        v = projected_v.reshape(kv_shape)
        if batch.is_verify and self.attention_kernel is not None:
            attn = self._verify_with_kernel(q, k, v, batch, state)
        elif not batch.is_verify and len(set(batch.start_positions)) == 1:
            attn = self._prefill_together(q, k, v, batch, state)
        else:
            attn = self._attend_each_sequence(q, k, v, batch, state)
        return projected_q, attn

    def _verifies_fused(self, x: torch.Tensor, batch: ForwardBatch, state: TargetState) -> bool:
        """Whether this call takes `_verify_fused`: a verify/decode call on the kernel path whose
        q, k and v come from one matmul and whose cache holds the activations' dtype."""
        return (
            batch.is_verify
            and self.attention_kernel is not None
            and self.qkv_projs is not None
            and self.qkv_projs.is_one_matmul
            and self.qkv_projs.accepts(x)
            and state.key_cache.dtype == x.dtype
            and self.q_norm.shares_settings(self.k_norm)
        )

    def _verify_fused(self, x, batch: ForwardBatch, state: TargetState, cos_sin):
        """`_project_and_attend` and the output gate on the verify path in fewer launches, bit
        for bit: one matmul for q, k and v, one kernel for the q/k norms and rotations and the
        cache writes (the query heads, each followed by its gate, read with a stride of
        2·head_dim), then the attention kernel, which applies the gate → attn · σ(gate)
        [B, T, heads·head_dim]. Only device tensors of the batch are read, so a CUDA graph of
        this replays."""
        from dflash_serve.kernels.attention_inputs import attention_inputs_into_cache

        qkv = self.qkv_projs.stacked(x)
        slots = batch.slot_index(x.device)
        q = attention_inputs_into_cache(
            qkv,
            self.num_heads,
            self.q_norm.weight,
            self.k_norm.weight,
            self.k_norm.eps,
            self.k_norm.zero_centred,
            *cos_sin,
            state.key_cache[self.attn_index],
            state.value_cache[self.attn_index],
            slots,
            batch.positions(x.device),
            query_stride=2 * self.head_dim,
        )
        gates = self._gates(qkv[..., : self.num_heads * 2 * self.head_dim])
        return self._attend_cache(q, slots, batch, state, gates)

    def _prefill_together(self, q, k, v, batch: ForwardBatch, state: TargetState):
        """Sequences at the same start position (training, equal-length prompts): one call.
        Padded prompts (`valid_tokens`, prompts of sessions sharing a prefill) attend one
        call each, as alone: flash attention splits the keys by batch × heads (its split-KV
        heuristic), so in one call a prompt's bits could depend on how many share it."""
        num_seqs, num_tokens = q.shape[:2]
        start = batch.start_positions[0]
        end = start + num_tokens
        slots = batch.slot_index(q.device)
        key_cache = state.key_cache[self.attn_index]
        value_cache = state.value_cache[self.attn_index]
        key_cache[slots, start:end] = k.to(key_cache.dtype)
        value_cache[slots, start:end] = v.to(value_cache.dtype)
        keys, values = key_cache[slots, :end], value_cache[slots, :end]
        if batch.valid_tokens is None:
            out = attend_causal(q, keys, values, self.scale)
        else:
            rows = [slice(b, b + 1) for b in range(num_seqs)]
            out = torch.cat([attend_causal(q[r], keys[r], values[r], self.scale) for r in rows])
        return out.reshape(num_seqs, num_tokens, -1)

    def _verify_with_kernel(self, q, k, v, batch: ForwardBatch, state: TargetState):
        """Only device tensors of the batch are read, so a CUDA graph of this replays."""
        slots = batch.slot_index(q.device)
        key_cache = state.key_cache[self.attn_index]
        value_cache = state.value_cache[self.attn_index]
        rows, positions = slots.unsqueeze(1), batch.positions(q.device)
        key_cache[rows, positions] = k.to(key_cache.dtype)
        value_cache[rows, positions] = v.to(value_cache.dtype)
        return self._attend_cache(q.contiguous(), slots, batch, state)

    def _attend_cache(
        self, q, slots, batch: ForwardBatch, state: TargetState, gates: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The attention kernel: queries [B, T, heads, head_dim] over the layer's cache, the
        block's keys and values already in it → [B, T, heads·head_dim], times σ(gates) where
        given."""
        out = self.attention_kernel(
            q,
            state.key_cache[self.attn_index],
            state.value_cache[self.attn_index],
            slots,
            batch.start_index(q.device),
            self.scale,
            gate=gates,
        )
        return out.reshape(*q.shape[:2], -1)

    def _attend_each_sequence(self, q, k, v, batch: ForwardBatch, state: TargetState):
        num_seqs, num_tokens = q.shape[:2]
        outputs = []
        for b, (slot, start) in enumerate(zip(batch.slots, batch.start_positions, strict=True)):
            end = start + num_tokens
            keys = state.key_cache[self.attn_index, slot]
            values = state.value_cache[self.attn_index, slot]
            keys[start:end] = k[b]
            values[start:end] = v[b]
            outputs.append(self._attend(q[b], keys[:end], values[:end], start, batch.is_verify))
        return torch.stack(outputs).reshape(num_seqs, num_tokens, -1)

    def _attend(self, q, keys, values, start: int, is_verify: bool) -> torch.Tensor:
        num_tokens = q.shape[0]
        if is_verify:
            ranges = [(0, start + t + 1) for t in range(num_tokens)]
            return attend_each_query(q, keys, values, ranges, self.scale)
        return attend_causal(q[None], keys[None], values[None], self.scale)[0]
