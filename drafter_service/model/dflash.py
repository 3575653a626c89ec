"""The DFlash drafter: one forward over [anchor, MASK×K] proposes K tokens.

Context: the target's tapped hidden states of committed tokens → fc → hidden_norm, turned
into extra keys/values by every layer's own k_proj/v_proj/k_norm and RoPE at their absolute
positions. Queries come only from the block, whose input is the target's embedding of the
block tokens. Attribute names match z-lab checkpoints (`fc`, `hidden_norm`, `layers.i.*`).

Two paths compute the draft: plain torch, one sequence at a time over its context plus the
block (CPU, reference); and after `use_gpu_kernels()` the Triton block-attention kernel over
the cache, where the block's keys are written as scratch after each slot's context and every
shape is static, so a CUDA graph of the step replays for any slots and context lengths.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from dflash_serve.layers.attention import attend_all, attend_masked
from dflash_serve.layers.linear import Linear, row_stable_linear, stack_dense_weights
from dflash_serve.layers.mlp import SwiGLU
from dflash_serve.layers.norms import RMSNorm
from dflash_serve.layers.rotary import RotaryEmbedding
from drafter_service.model.config import DFlashConfig
from drafter_service.model.context_cache import DrafterContextCache


class DrafterAttention(nn.Module):
    """Qwen3-style attention (plain RMSNorm q/k norms, full RoPE) over context + block."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.q_proj = Linear(hidden, self.num_heads * self.head_dim)
        self.k_proj = Linear(hidden, self.num_kv_heads * self.head_dim)
        self.v_proj = Linear(hidden, self.num_kv_heads * self.head_dim)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden)
        self.q_norm = RMSNorm(self.head_dim, eps, zero_centred=False)
        self.k_norm = RMSNorm(self.head_dim, eps, zero_centred=False)
        self.qkv_weight: torch.Tensor | None = None  # set by stack_projections

    def stack_projections(self) -> None:
        """q, k and v as one matmul over their stacked weights (k and v alone: a view of its
        tail), on both paths (`projections`, and `into_cache` feeding the kernel path's
        `attention_inputs_into_cache`). The linears become views of the stacked weight (no
        second copy). Idempotent."""
        if self.qkv_weight is None:
            self.qkv_weight = stack_dense_weights([self.q_proj, self.k_proj, self.v_proj])

    def stack_for_fused_inputs(self) -> None:
        """`stack_projections` for the kernel path, whose fused q/k kernel applies one eps and
        one kind of norm to both heads: refused (ValueError) when the two norms differ."""
        if not self.q_norm.shares_settings(self.k_norm):
            raise ValueError("the fused q/k kernel needs one eps and one kind for both norms")
        self.stack_projections()

    def projections(self, x: torch.Tensor, cos_sin) -> tuple[torch.Tensor, ...]:
        """x [..., T, hidden] → (rotated queries [..., T, heads, head_dim], rotated keys and
        values [..., T, kv_heads, head_dim]): one matmul after `stack_projections`."""
        if self.qkv_weight is None:
            return self.queries(x, cos_sin), *self.keys_values(x, cos_sin)
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = F.linear(x, self.qkv_weight).split([q_width, kv_width, kv_width], dim=-1)
        return self._rotated_queries(q, cos_sin), *self._rotated_keys_values(k, v, cos_sin)

    def into_cache(
        self,
        x: torch.Tensor,
        cos_sin,
        keys: torch.Tensor,
        values: torch.Tensor,
        slot_ids: torch.Tensor,
        positions: torch.Tensor,
        with_queries: bool,
    ) -> torch.Tensor | None:
        """x [B, T, hidden] → keys and values written into one layer's cache [slots, L, …] at
        (slot_ids[b], positions[b, t]); returns the rotated queries [B, T, heads, head_dim]
        (None without queries: context rows). One matmul and one kernel (after
        `stack_projections`)."""
        from dflash_serve.kernels.attention_inputs import attention_inputs_into_cache

        num_q_heads = self.num_heads if with_queries else 0
        weight = self.qkv_weight[(self.num_heads - num_q_heads) * self.head_dim :]
        return attention_inputs_into_cache(
            F.linear(x, weight),
            num_q_heads,
            self.q_norm.weight,
            self.k_norm.weight,
            self.k_norm.eps,
            self.k_norm.zero_centred,
            *cos_sin,
            keys,
            values,
            slot_ids,
            positions,
        )

    def keys_values(self, x: torch.Tensor, cos_sin) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., T, hidden] → rotated keys and values [..., T, kv_heads, head_dim] (one
        matmul after `stack_projections`)."""
        if self.qkv_weight is None:
            keys, values = self.k_proj(x), self.v_proj(x)
        else:
            tail = self.qkv_weight[self.num_heads * self.head_dim :]
            keys, values = F.linear(x, tail).chunk(2, dim=-1)
        return self._rotated_keys_values(keys, values, cos_sin)

    def queries(self, x: torch.Tensor, cos_sin) -> torch.Tensor:
        return self._rotated_queries(self.q_proj(x), cos_sin)

    def _rotated_queries(self, q: torch.Tensor, cos_sin) -> torch.Tensor:
        """Projected queries [..., heads·head_dim] → normed and rotated heads."""
        heads = q.reshape(*q.shape[:-1], self.num_heads, self.head_dim)
        return self.q_norm.norm_and_rotate(heads, cos_sin)

    def _rotated_keys_values(self, k: torch.Tensor, v: torch.Tensor, cos_sin):
        """Projected keys and values [..., kv_heads·head_dim] → normed and rotated key heads,
        value heads."""
        shape = (*k.shape[:-1], self.num_kv_heads, self.head_dim)
        return self.k_norm.norm_and_rotate(k.reshape(shape), cos_sin), v.reshape(shape)


class DrafterLayer(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.self_attn = DrafterAttention(config)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, zero_centred=False)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, zero_centred=False)


class DFlashDrafter(nn.Module):
    """Weights of the drafter plus the borrowed target embedding and head."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.fc = Linear(len(config.target_layer_ids) * hidden, hidden)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps, zero_centred=False)
        self.layers = nn.ModuleList(DrafterLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(hidden, config.rms_norm_eps, zero_centred=False)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)
        self.embed_weight: torch.Tensor | None = None  # [vocab, hidden], from the target
        self.head_weight: torch.Tensor | None = None
        self.attention_kernel = None  # set by use_gpu_kernels

    def stack_weights(self) -> None:
        """Every layer's q, k and v as one matmul and its MLP's gate and up as another, on any
        device: drafts need not be row-independent (the target decides every token), and a
        CPU draft step is mostly per-op cost. The loader calls this."""
        for module in self.modules():
            if isinstance(module, DrafterAttention):
                module.stack_projections()
            elif isinstance(module, SwiGLU):
                module.stack_gate_up(with_kernel=False)

    def use_gpu_kernels(self) -> None:
        """Triton kernels (imported here: a GPU dependency): the block attention over the cache;
        the norms, each fused with the residual add before it; the stacked q, k and v matmul's
        heads normalised, rotated and written into the cache by one kernel; silu·up as one
        kernel after the stacked gate and up matmul. Without them a draft step was ~640
        launches, half its time elementwise work. Matmuls stay on cuBLAS."""
        from dflash_serve.kernels.block_attention import block_attention

        self.attention_kernel = block_attention
        for module in self.modules():
            if isinstance(module, DrafterAttention):
                module.stack_for_fused_inputs()
            elif isinstance(module, RMSNorm):
                module.use_row_kernel()
            elif isinstance(module, SwiGLU):
                module.stack_gate_up()

    @property
    def uses_gpu_kernels(self) -> bool:
        return self.attention_kernel is not None

    def add_context(self, cache: DrafterContextCache, slot: int, features: torch.Tensor) -> None:
        """Append committed tokens' tapped target features [n, taps·hidden] to a slot."""
        if self.uses_gpu_kernels:  # the fused step's kernels, so both give the same keys
            self.add_contexts(cache, [slot], [features])
            return
        start = cache.lengths[slot]
        end = start + features.shape[0]
        context = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))
        positions = torch.arange(start, end, device=features.device)
        cos_sin = self.rotary.cos_sin(positions)
        for layer_id, layer in enumerate(self.layers):
            keys, values = layer.self_attn.keys_values(context, cos_sin)
            cache.keys[layer_id, slot, start:end] = keys
            cache.values[layer_id, slot, start:end] = values
        cache.lengths[slot] = end

    def add_contexts(
        self, cache: DrafterContextCache, slots: list[int], features: list[torch.Tensor]
    ) -> None:
        """`add_context` for several slots, features [n_i, taps·hidden] each: on the kernel
        path one forward for all (every row its own slot id and position), so sessions that
        start together add their prompts without a forward's launches each; on the plain
        path slot by slot."""
        if not self.uses_gpu_kernels:
            for slot, rows in zip(slots, features, strict=True):
                self.add_context(cache, slot, rows)
            return
        weight = self.fc.weight
        parts = [part.to(weight.device, weight.dtype) for part in features]
        rows = parts[0] if len(parts) == 1 else torch.cat(parts)  # one slot's: no copy
        ids = packed_row_ids(cache, slots, [part.shape[0] for part in features]).to(rows.device)
        self.add_context_on_device(cache, ids[0], ids[1], rows.unsqueeze(1))
        for slot, part in zip(slots, features, strict=True):
            cache.lengths[slot] += part.shape[0]

    def add_context_on_device(
        self,
        cache: DrafterContextCache,
        slot_ids: torch.Tensor,
        start_ids: torch.Tensor,
        features: torch.Tensor,
    ) -> None:
        """`add_context` for B slots from device tensors only: features [B, R, taps·hidden]
        go to positions start .. start + R − 1 (rows past a slot's real count are padding:
        beyond its length, so never attended, and overwritten by the next block). A slot may
        come more than once (`add_contexts`: one row per entry). The host keeps
        `cache.lengths`; a CUDA graph of this replays for new values."""
        context = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))
        positions = block_positions(start_ids, features.shape[1])
        cos_sin = self.rotary.cos_sin(positions)
        for layer_id, layer in enumerate(self.layers):
            keys, values = cache.keys[layer_id], cache.values[layer_id]
            layer.self_attn.into_cache(
                context, cos_sin, keys, values, slot_ids, positions, with_queries=False
            )

    def draft_logits(
        self, cache: DrafterContextCache, slots: list[int], block_ids: torch.Tensor
    ) -> torch.Tensor:
        """block_ids [B, T] = [anchor, MASK…] at positions starting at each slot's context
        length → fp32 logits [B, T−1, vocab] for block positions 1..T−1."""
        device = block_ids.device
        starts = [cache.lengths[s] for s in slots]
        if self.uses_gpu_kernels:
            ids = torch.tensor((slots, starts), dtype=torch.int64, device=device)
            return self.draft_logits_on_device(cache, ids[0], ids[1], block_ids)
        num_tokens = block_ids.shape[1]
        positions = block_positions(torch.tensor(starts, device=device), num_tokens)
        masks = self._block_masks(starts, num_tokens, device)
        attend = partial(self._attend, cache=cache, slots=slots, masks=masks)
        return self._forward_block(block_ids, positions, attend)

    def draft_logits_on_device(
        self,
        cache: DrafterContextCache,
        slot_ids: torch.Tensor,
        start_ids: torch.Tensor,
        block_ids: torch.Tensor,
    ) -> torch.Tensor:
        """`draft_logits` on the kernel path from device tensors only: slot_ids [B] int64,
        start_ids [B] int64 (the slots' context lengths), block_ids [B, T] int64. Nothing is
        read on the host, so a CUDA graph of this replays for new values in the same tensors.
        Writes the block's keys/values at positions start .. start + T − 1 of each slot."""
        assert self.uses_gpu_kernels, "draft_logits_on_device needs use_gpu_kernels()"
        positions = block_positions(start_ids, block_ids.shape[1])
        attend = partial(
            self._attend_in_cache,
            cache=cache,
            slot_ids=slot_ids,
            start_ids=start_ids,
            positions=positions,
        )
        return self._forward_block(block_ids, positions, attend)

    def _forward_block(
        self, block_ids: torch.Tensor, positions: torch.Tensor, attend: Callable
    ) -> torch.Tensor:
        """The layers over the block at `positions` [B, T]; `attend(layer_id, layer, x, cos_sin)`
        is the attention of one layer (context plus block) → fp32 logits [B, T−1, vocab]."""
        cos_sin = self.rotary.cos_sin(positions)
        scale = self.config.input_embedding_scale
        h = nn.functional.embedding(block_ids, self.embed_weight) * scale
        normed = self.layers[0].input_layernorm(h)
        next_norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        for layer_id, (layer, next_norm) in enumerate(zip(self.layers, next_norms, strict=True)):
            attended = attend(layer_id, layer, normed, cos_sin)
            h, normed = layer.post_attention_layernorm.add_and_norm(h, attended)
            h, normed = next_norm.add_and_norm(h, layer.mlp(normed))
        return self.normed_head_logits(normed[:, 1:])

    def head_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Block hidden states [..., hidden] → fp32 draft logits [..., vocab]."""
        return self.normed_head_logits(self.norm(h))

    def normed_head_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """The final norm's output [..., hidden] → fp32 draft logits [..., vocab]. The rows go
        to one matmul as one contiguous 2-D input: a strided [B, T, hidden] view (the block
        without its anchor) became one GEMM per sequence, each re-reading the 1.3 GB head
        (8 sequences: 2.5 ms instead of 0.35 on the H200)."""
        rows = normed.reshape(-1, normed.shape[-1]).contiguous()
        logits = row_stable_linear(rows, self.head_weight).float()
        logits = logits.reshape(*normed.shape[:-1], logits.shape[-1])
        logits = logits * self.config.output_multiplier
        softcap = self.config.final_logit_softcapping
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        return logits

    def _block_masks(self, starts: list[int], num_tokens: int, device) -> list[list]:
        """Per layer, per sequence: `visibility` of the block's queries, or None where every
        key is visible (a non-causal layer without a window: DFlash's own); built once per
        draft for each distinct layer rule."""
        by_rule: dict[tuple, list] = {}
        masks = []
        for layer_id in range(len(self.layers)):
            rule = (self.config.layer_is_causal(layer_id), self.config.layer_window(layer_id))
            if rule not in by_rule:
                by_rule[rule] = [
                    None
                    if rule == (False, None)
                    else self.visibility(layer_id, start, num_tokens, device)
                    for start in starts
                ]
            masks.append(by_rule[rule])
        return masks

    def _attend(self, layer_id, layer, x, cos_sin, cache, slots, masks) -> torch.Tensor:
        """The plain path: the block's keys/values go into the cache as scratch after the
        context (as on the kernel path), so each sequence attends over one view of it."""
        attn = layer.self_attn
        queries, block_keys, block_values = attn.projections(x, cos_sin)
        outputs = []
        for b, slot in enumerate(slots):
            start = cache.lengths[slot]
            end = start + x.shape[1]
            keys, values = cache.keys[layer_id, slot], cache.values[layer_id, slot]
            keys[start:end] = block_keys[b]
            values[start:end] = block_values[b]
            visible, scale = masks[layer_id][b], attn.head_dim**-0.5
            if visible is None:
                outputs.append(attend_all(queries[b], keys[:end], values[:end], scale))
            else:
                outputs.append(attend_masked(queries[b], keys[:end], values[:end], visible, scale))
        out = torch.stack(outputs).reshape(*x.shape[:2], -1)
        return attn.o_proj(out)

    def _attend_in_cache(
        self, layer_id, layer, x, cos_sin, cache, slot_ids, start_ids, positions
    ) -> torch.Tensor:
        """The block's keys go into the cache after the context (scratch: the kernel reads them
        by position, the next add_context overwrites them); the kernel applies the layer's
        causal and window rules by position."""
        attn = layer.self_attn
        keys, values = cache.keys[layer_id], cache.values[layer_id]
        queries = attn.into_cache(x, cos_sin, keys, values, slot_ids, positions, with_queries=True)
        out = self.attention_kernel(
            queries,
            keys,
            values,
            slot_ids,
            start_ids,
            attn.head_dim**-0.5,
            causal=self.config.layer_is_causal(layer_id),
            window=self.config.layer_window(layer_id),
        )
        return attn.o_proj(out.reshape(*x.shape[:2], -1))

    def visibility(self, layer_id: int, start: int, num_tokens: int, device) -> torch.Tensor:
        """bool [T, start+T]: which keys (context, then block) each block query sees."""
        query_pos = torch.arange(start, start + num_tokens, device=device).unsqueeze(1)
        key_pos = torch.arange(start + num_tokens, device=device).unsqueeze(0)
        return self.visible_by_position(layer_id, query_pos, key_pos)

    def visible_by_position(
        self, layer_id: int, query_pos: torch.Tensor, key_pos: torch.Tensor
    ) -> torch.Tensor:
        """The layer's causal and window rules on broadcastable absolute positions."""
        visible = torch.ones(
            torch.broadcast_shapes(query_pos.shape, key_pos.shape),
            dtype=torch.bool,
            device=query_pos.device,
        )
        is_causal = self.config.layer_is_causal(layer_id)
        if is_causal:
            visible &= key_pos <= query_pos
        window = self.config.layer_window(layer_id)
        if window is not None:
            visible &= query_pos - key_pos < window
            if not is_causal:
                visible &= key_pos - query_pos < window
        return visible


def packed_row_ids(cache: DrafterContextCache, slots: list[int], counts: list[int]) -> torch.Tensor:
    """Slot ids and positions [2, sum(counts)] (int64, on the host) of context rows packed
    slot after slot: counts[i] rows of slots[i], from its current length on."""
    counts = torch.tensor(counts)
    first_rows = counts.cumsum(0) - counts  # each slot's first row in the packing
    starts = torch.tensor([cache.lengths[slot] for slot in slots])
    row_slots = torch.tensor(slots).repeat_interleave(counts)
    row_positions = torch.arange(int(counts.sum())) + (starts - first_rows).repeat_interleave(
        counts
    )
    return torch.stack((row_slots, row_positions))


def block_positions(starts: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Absolute positions [B, T] of blocks of T tokens starting at `starts` [B]."""
    return starts.unsqueeze(1) + torch.arange(num_tokens, device=starts.device)
