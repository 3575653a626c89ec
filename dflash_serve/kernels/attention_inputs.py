"""Attention inputs from one q|k|v projection, in one kernel: queries out, keys and values
into the cache.

An attention layer's verify or draft step took a norm-and-rotary launch each for its queries
and keys and two indexed writes (`index_put_`) of keys and values into the cache: in a
CUDA-graphed step, launches that each move a few kilobytes, several per layer. Here one program
per (token, head) of the stacked projection's output normalises and rotates a query head into
the queries, normalises and rotates a key head straight into the cache at its (slot,
position), or copies a value head beside it. Context rows of the drafter (keys and values
only) take the same kernel without query heads; Qwen3.5's query heads, each followed by its
output gate, are read with a head stride of twice the head dim.

Bit for bit `norm_rotary` on the query and key heads, then the indexed writes: the norm and
rotation are the same device code (`_scaled_norm`, `store_rotated`), and a token's bits do not
depend on how many tokens share the launch, so the target's verify path may use it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dflash_serve.kernels import is_interpreting, launch_options
from dflash_serve.kernels.jit_math import wait_for_inputs
from dflash_serve.kernels.norm_rotary import norm_rotary_reference, store_rotated
from dflash_serve.kernels.rms_norm import _num_warps, _scaled_norm

# A block has 16 rows per sequence, a context add any number (an eager add: the new tokens):
# specialised, counts of 1 and multiples of 16 would each compile a variant mid-request. The
# slot ids may be a view at any offset of the caller's index tensor.
ROWS_PER_SEQUENCE_NOT_SPECIALISED = ["rows_per_sequence"]
INDEX_POINTERS = ["slot_ptr", "position_ptr"]


@triton.jit(
    do_not_specialize=ROWS_PER_SEQUENCE_NOT_SPECIALISED,
    do_not_specialize_on_alignment=INDEX_POINTERS,
)
def _attention_inputs_kernel(
    qkv_ptr, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr, queries_ptr, keys_ptr, values_ptr,
    slot_ptr, position_ptr, qkv_stride_row, cs_stride_row, cache_stride_slot,
    cache_stride_position, rows_per_sequence, eps,
    NUM_Q_HEADS: tl.constexpr, Q_STRIDE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, D: tl.constexpr,
    BLOCK: tl.constexpr, HALF: tl.constexpr, ZERO_CENTRED: tl.constexpr,
    INTERPRETED: tl.constexpr,
):  # fmt: skip
    """Program (row, head) over heads [queries | keys | values] of one projected row; query
    head h starts at h·Q_STRIDE, key/value head j at NUM_Q_HEADS·Q_STRIDE + j·D."""
    wait_for_inputs()
    program = tl.program_id(0).to(tl.int64)
    row = program // (NUM_Q_HEADS + 2 * NUM_KV_HEADS)
    head = program % (NUM_Q_HEADS + 2 * NUM_KV_HEADS)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    offset = tl.where(head < NUM_Q_HEADS, head * Q_STRIDE, NUM_Q_HEADS * (Q_STRIDE - D) + head * D)
    x = tl.load(qkv_ptr + row * qkv_stride_row + offset + cols, mask=mask, other=0.0)
    cos_row = cos_ptr + row * cs_stride_row
    sin_row = sin_ptr + row * cs_stride_row
    if head < NUM_Q_HEADS:
        y = _scaled_norm(x.to(tl.float32), q_weight_ptr, cols, mask, D, eps, ZERO_CENTRED,
                         INTERPRETED)  # fmt: skip
        out_row = queries_ptr + (row * NUM_Q_HEADS + head) * D
        store_rotated(y, out_row, cols, mask, cos_row, sin_row, HALF, INTERPRETED)
    else:
        slot = tl.load(slot_ptr + row // rows_per_sequence)
        position = tl.load(position_ptr + row)
        cache_offset = slot * cache_stride_slot + position * cache_stride_position
        kv_head = head - NUM_Q_HEADS
        if kv_head < NUM_KV_HEADS:
            y = _scaled_norm(x.to(tl.float32), k_weight_ptr, cols, mask, D, eps, ZERO_CENTRED,
                             INTERPRETED)  # fmt: skip
            out_row = keys_ptr + cache_offset + kv_head * D
            store_rotated(y, out_row, cols, mask, cos_row, sin_row, HALF, INTERPRETED)
        else:
            out_row = values_ptr + cache_offset + (kv_head - NUM_KV_HEADS) * D
            tl.store(out_row + cols, x, mask=mask)


def attention_inputs_into_cache(
    qkv: torch.Tensor,
    num_q_heads: int,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor,
    eps: float,
    zero_centred: bool,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slot_ids: torch.Tensor,
    positions: torch.Tensor,
    query_stride: int | None = None,
) -> torch.Tensor | None:
    """Split projected rows into heads, write keys and values into the cache, return queries.

    qkv: [B, T, Hq·S + 2·Hkv·D] with unit last stride, each row its Hq query heads (head h at
    h·S, S = `query_stride`, default D; the rest of each stride, such as Qwen3.5's gate, is
    not read), then Hkv key heads and Hkv value heads (Hq may be 0: context rows, keys and
    values only); q_weight,
    k_weight: the per-head norms' weights [D]; cos, sin: fp32 [B, T, ROT]; keys, values:
    one layer's cache [slots, L, Hkv, D], x's dtype, contiguous; slot_ids: int64 [B];
    positions: int64 [B, T]. Row (b, t)'s normalised, rotated key heads go to
    keys[slot_ids[b], positions[b, t]] and its value heads to values[...]. Returns the
    normalised, rotated queries [B, T, Hq, D] (None if Hq is 0). No host synchronisation,
    so slot ids and positions are NOT checked: the caller keeps them in range (slots below
    the cache's, positions below L; a position >= L would write into the next slot's rows).
    """
    num_kv_heads, dim = keys.shape[-2:]
    query_stride = dim if query_stride is None else query_stride
    if query_stride < dim:
        raise ValueError(f"query_stride must be at least the head dim {dim}, got {query_stride}")
    batch, tokens = _check_shapes(
        qkv, num_q_heads * query_stride, keys, values, slot_ids, positions
    )
    rotary_dim = cos.shape[-1]
    if cos.shape != (batch, tokens, rotary_dim) or sin.shape != cos.shape:
        raise ValueError(f"cos and sin must be [{batch}, {tokens}, ROT], got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")  # fmt: skip
    if rotary_dim % 2 or not 0 < rotary_dim <= dim:
        raise ValueError(f"rotary_dim must be even and in 2..{dim}, got {rotary_dim}")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError(f"cos and sin must be float32, got {cos.dtype} and {sin.dtype}")
    if num_q_heads and q_weight is None:
        raise ValueError("q_weight is needed when there are query heads")
    _check_devices(qkv, q_weight if num_q_heads else None, k_weight, cos, sin, keys, values,
                   slot_ids, positions)  # fmt: skip
    queries = None
    if num_q_heads:
        queries = torch.empty((batch, tokens, num_q_heads, dim), dtype=qkv.dtype, device=qkv.device)
    if batch * tokens == 0:
        return queries
    rows = qkv.reshape(batch * tokens, qkv.shape[-1])
    block = triton.next_power_of_2(dim)
    heads = num_q_heads + 2 * num_kv_heads
    _attention_inputs_kernel[(batch * tokens * heads,)](
        rows, k_weight if q_weight is None else q_weight, k_weight,
        cos.reshape(-1, rotary_dim).contiguous(), sin.reshape(-1, rotary_dim).contiguous(),
        keys if queries is None else queries, keys, values,
        slot_ids, positions.contiguous(), rows.stride(0), rotary_dim, keys.stride(0),
        keys.stride(1), tokens, eps,
        NUM_Q_HEADS=num_q_heads, Q_STRIDE=query_stride, NUM_KV_HEADS=num_kv_heads, D=dim,
        BLOCK=block,
        HALF=rotary_dim // 2, ZERO_CENTRED=zero_centred, INTERPRETED=is_interpreting(),
        num_warps=_num_warps(block), **launch_options(),
    )  # fmt: skip
    return queries


def attention_inputs_into_cache_reference(
    qkv, num_q_heads, q_weight, k_weight, eps, zero_centred, cos, sin, keys, values, slot_ids,
    positions, query_stride=None,
) -> torch.Tensor | None:  # fmt: skip
    """The plain-torch path of `attention_inputs_into_cache` (same arguments): split the
    heads, `norm_rotary_reference`, indexed writes."""
    num_kv_heads, dim = keys.shape[-2:]
    query_stride = dim if query_stride is None else query_stride
    q_width = num_q_heads * query_stride
    q = qkv[..., :q_width].reshape(*qkv.shape[:-1], num_q_heads, query_stride)[..., :dim]
    kv = qkv[..., q_width:].reshape(*qkv.shape[:-1], 2 * num_kv_heads, dim)
    k, v = kv.split(num_kv_heads, dim=-2)
    rows = slot_ids.unsqueeze(1)
    keys[rows, positions] = norm_rotary_reference(k, k_weight, eps, zero_centred, cos, sin)
    values[rows, positions] = v
    if not num_q_heads:
        return None
    return norm_rotary_reference(q, q_weight, eps, zero_centred, cos, sin)


def _check_shapes(qkv, q_width, keys, values, slot_ids, positions) -> tuple[int, int]:
    if keys.dim() != 4 or values.shape != keys.shape:
        raise ValueError(f"keys and values must be one [slots, L, kv_heads, D] shape, got "
                         f"{tuple(keys.shape)} and {tuple(values.shape)}")  # fmt: skip
    if not (keys.is_contiguous() and values.is_contiguous()):
        raise ValueError("keys and values must be contiguous")
    num_kv_heads, dim = keys.shape[-2:]
    width = q_width + 2 * num_kv_heads * dim
    if qkv.dim() != 3 or qkv.shape[-1] != width or qkv.stride(-1) != 1:
        raise ValueError(f"qkv must be [B, T, {width}] with a unit last stride, got "
                         f"{tuple(qkv.shape)} strides {qkv.stride()}")  # fmt: skip
    if qkv.dtype != keys.dtype or values.dtype != keys.dtype:
        raise ValueError(f"qkv, keys and values must share a dtype, got {qkv.dtype}, "
                         f"{keys.dtype} and {values.dtype}")  # fmt: skip
    batch, tokens = qkv.shape[:2]
    if slot_ids.shape != (batch,) or positions.shape != (batch, tokens):
        raise ValueError(f"slot_ids must be [{batch}] and positions [{batch}, {tokens}], got "
                         f"{tuple(slot_ids.shape)} and {tuple(positions.shape)}")  # fmt: skip
    if slot_ids.dtype != torch.int64 or positions.dtype != torch.int64:
        raise ValueError("slot_ids and positions must be int64")
    return batch, tokens


def _check_devices(qkv, q_weight, k_weight, *tensors) -> None:
    """The norms' weights: float [D]; every tensor on qkv's device."""
    dim = tensors[-4].shape[-1]  # keys [slots, L, kv_heads, D]
    for name, weight in (("q_weight", q_weight), ("k_weight", k_weight)):
        if weight is None:
            continue
        if weight.shape != (dim,) or not weight.is_floating_point():
            raise ValueError(f"{name} must be a float [{dim}] tensor, got {weight.dtype} "
                             f"{tuple(weight.shape)}")  # fmt: skip
        tensors = (*tensors, weight)
    devices = {tensor.device for tensor in tensors}
    if devices != {qkv.device}:
        raise ValueError(f"every tensor must be on qkv's device {qkv.device}, got {devices}")
