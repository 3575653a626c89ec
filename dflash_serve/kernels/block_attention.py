"""Attention of a block of T new tokens per sequence over a slotted KV cache (GQA).

The target's verify/decode step (causal, no window) and the drafter's draft step (its layers'
causal and sliding-window rules) both attend this way: the block's own keys/values are already
written into the cache at positions start .. start + T − 1 of each sequence's slot.

One program owns one sequence, one kv head and a tile of up to `tile_tokens` block tokens; its
BLOCK_M rows are the (token, query head of the group) pairs, row r = token r // G, head r % G,
so the group's queries share every key/value tile they load. Rows past the block are padding.

Row independence (lossless speculative decoding needs it): a query's output is bit-identical
whatever T, B or tile row it lands in, because
- the launch configuration depends only on (H, Hkv, D) and the visibility rule, never on T, B
  or L;
- key blocks start at fixed positions 0, BLOCK_N, 2·BLOCK_N, … for every row and every call, so
  a row meets the same key tiles in the same order with the same per-element arithmetic;
- a program loops over the union of its rows' key ranges, and a block entirely masked for a row
  leaves that row's running max m, sum l and accumulator bit-for-bit unchanged: every score is
  −inf, so max(m, −inf) = m, the rescale factor is exp2(m − m) = exp2(0) = 1 exactly, every
  p = exp2(−inf) = 0 exactly, and l·1 + 0 = l, acc·1 + (P·V = 0) = acc. A row whose max is still
  −inf (padding, or no key seen yet) subtracts 0 instead of −inf, since −inf − (−inf) is NaN.
  So which masked blocks a program visits (a window skips the blocks before its first row's
  range) does not change any row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dflash_serve.kernels import is_interpreting
from dflash_serve.layers.attention import attend_each_query

# A full speculative block (anchor + 15 drafts) is one tile when the group allows it.
MAX_TILE_TOKENS = 16
MAX_ROWS_PER_TILE = 64
LOG2E = math.log2(math.e)


@dataclass(frozen=True)
class LaunchConfig:
    """The one launch configuration of a head shape; nothing in it depends on T, B or L."""

    tile_tokens: int
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def launch_config(num_heads: int, num_kv_heads: int, head_dim: int) -> LaunchConfig:
    """Up to 16 tokens × the group per tile (64 rows = 16 × 4 for Qwen3.5-4B).

    Wide heads take narrower key tiles and more warps to keep the fp32 accumulator in registers.
    """
    group = num_heads // num_kv_heads
    tile_tokens = max(1, min(MAX_TILE_TOKENS, MAX_ROWS_PER_TILE // group))
    block_m = max(16, triton.next_power_of_2(tile_tokens * group))
    if head_dim <= 64:
        return LaunchConfig(tile_tokens, block_m, block_n=64, num_warps=4, num_stages=2)
    if head_dim <= 128:
        return LaunchConfig(tile_tokens, block_m, block_n=64, num_warps=8, num_stages=2)
    return LaunchConfig(tile_tokens, block_m, block_n=32, num_warps=8, num_stages=2)


# Value-specialising T or the T-dependent strides could compile a different kernel per T.
@triton.jit(
    do_not_specialize=["num_tokens", "q_stride_b", "q_stride_t", "o_stride_b", "o_stride_t"]
)
def _block_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    slots_ptr,
    starts_ptr,
    num_tokens,
    cache_len,
    q_stride_b,
    q_stride_t,
    q_stride_h,
    o_stride_b,
    o_stride_t,
    o_stride_h,
    cache_stride_slot,
    cache_stride_pos,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    TILE_TOKENS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    WINDOW: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    first_token = tl.program_id(2) * TILE_TOKENS

    rows = tl.arange(0, BLOCK_M)
    tokens = first_token + rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    is_row = (rows < TILE_TOKENS * GROUP) & (tokens < num_tokens)
    dims = tl.arange(0, HEAD_DIM)

    slot = tl.load(slots_ptr + seq).to(tl.int64)
    start = tl.load(starts_ptr + seq).to(tl.int32)
    query_pos = start + tokens
    last_token = tl.minimum(num_tokens, first_token + TILE_TOKENS) - 1
    if IS_CAUSAL:
        row_ends = tl.where(is_row, query_pos + 1, 0)
        program_end = start + last_token + 1
    else:
        row_ends = tl.where(is_row, start + num_tokens, 0)
        program_end = start + num_tokens
    loop_start = 0
    if HAS_WINDOW:
        row_starts = query_pos - WINDOW + 1
        program_start = tl.maximum(start + first_token - WINDOW + 1, 0)
        # Aligned down to BLOCK_N: the key blocks stay at the same positions for every row.
        loop_start = program_start // BLOCK_N * BLOCK_N
        if not IS_CAUSAL:
            row_ends = tl.minimum(row_ends, query_pos + WINDOW)
            program_end = tl.minimum(program_end, start + last_token + WINDOW)
    load_end = tl.minimum(program_end, cache_len)

    q_rows = seq * q_stride_b + tokens * q_stride_t + heads * q_stride_h
    q = tl.load(q_ptr + q_rows[:, None] + dims[None, :], mask=is_row[:, None], other=0.0)
    if DOT_IN_FP32:
        q = q.to(tl.float32)
    cache_base = slot * cache_stride_slot + kv_head * HEAD_DIM

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for block_start in range(loop_start, program_end, BLOCK_N):
        keys_pos = block_start + tl.arange(0, BLOCK_N)
        is_loaded = keys_pos < load_end
        if HAS_WINDOW:
            is_loaded = is_loaded & (keys_pos >= program_start)
        kv_offsets = cache_base + keys_pos * cache_stride_pos
        k_t = tl.load(
            k_ptr + kv_offsets[None, :] + dims[:, None], mask=is_loaded[None, :], other=0.0
        )
        v = tl.load(v_ptr + kv_offsets[:, None] + dims[None, :], mask=is_loaded[:, None], other=0.0)
        if DOT_IN_FP32:
            scores = tl.dot(q, k_t.to(tl.float32), input_precision="ieee")
        else:
            scores = tl.dot(q, k_t)
        is_visible = keys_pos[None, :] < row_ends[:, None]
        if HAS_WINDOW:
            is_visible = is_visible & (keys_pos[None, :] >= row_starts[:, None])
        scores = tl.where(is_visible, scores * qk_scale, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_base)
        p = tl.exp2(scores - m_base[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # P is rounded to V's dtype in both modes so the interpreter rounds like the GPU.
        p = p.to(v.dtype)
        if DOT_IN_FP32:
            pv = tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p, v)
        # A separate P·V (not accumulated into acc) keeps a masked block an exact `+ 0`.
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_rows = seq * o_stride_b + tokens * o_stride_t + heads * o_stride_h
    tl.store(
        out_ptr + o_rows[:, None] + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=is_row[:, None],
    )


def block_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    start_positions: torch.Tensor,
    scale: float,
    *,
    causal: bool = True,
    window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of B blocks of T tokens each over their slots of one layer's KV cache.

    q [B, T, H, D] bf16 or fp32, already normed and rotated; key_cache/value_cache [S, L, Hkv, D]
    of q's dtype, contiguous, the blocks' own keys already written; slots [B] int64;
    start_positions [B] int32/int64, the position of block token 0. Query t of sequence b sits
    at p = start_positions[b] + t; it (query head h uses kv head h // (H / Hkv)) sees the cache
    positions [lo, hi) of slot slots[b], where hi = p + 1 if `causal` else start + T, and with a
    `window`: lo = max(0, p − window + 1) and, when not causal, hi = min(hi, p + window);
    otherwise lo = 0. The caller guarantees start_positions[b] + T <= L (not checked: no host
    sync). `causal` and `window` are compile-time constants (one kernel per rule).
    Softmax in fp32 (online); returns [B, T, H, D] in q's dtype, written into `out` if given.
    Graph-capturable: the launch depends on shapes only. fp32 inputs always take the IEEE fp32
    dot (the default TF32 would lose precision).
    """
    _check_inputs(q, key_cache, value_cache, slots, start_positions, out, window)
    num_seqs, num_tokens, num_heads, head_dim = q.shape
    cache_len, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    config = launch_config(num_heads, num_kv_heads, head_dim)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    grid = (num_seqs, num_kv_heads, triton.cdiv(num_tokens, config.tile_tokens))
    _block_attention_kernel[grid](
        q,
        key_cache,
        value_cache,
        out,
        slots,
        start_positions,
        num_tokens,
        cache_len,
        *q.stride()[:3],
        *out.stride()[:3],
        key_cache.stride(0),
        key_cache.stride(1),
        scale * LOG2E,
        HEAD_DIM=head_dim,
        GROUP=num_heads // num_kv_heads,
        TILE_TOKENS=config.tile_tokens,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        IS_CAUSAL=bool(causal),
        HAS_WINDOW=window is not None,
        WINDOW=0 if window is None else int(window),
        DOT_IN_FP32=is_interpreting() or q.dtype == torch.float32,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def block_attention_reference(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    start_positions: torch.Tensor,
    scale: float,
    *,
    causal: bool = True,
    window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`block_attention` in plain torch fp32, one sequence at a time (reads slots on the host)."""
    _check_inputs(q, key_cache, value_cache, slots, start_positions, out, window)
    num_tokens = q.shape[1]
    results = []
    for b, (slot, start) in enumerate(zip(slots.tolist(), start_positions.tolist(), strict=True)):
        ranges = [
            visible_range(start + t, start + num_tokens, causal, window) for t in range(num_tokens)
        ]
        results.append(attend_each_query(q[b], key_cache[slot], value_cache[slot], ranges, scale))
    result = torch.stack(results)
    if out is None:
        return result
    return out.copy_(result)


def visible_range(
    query_pos: int, block_end: int, causal: bool, window: int | None
) -> tuple[int, int]:
    """The key positions [lo, hi) a query at `query_pos` sees (its block ends at `block_end`)."""
    lo, hi = 0, query_pos + 1 if causal else block_end
    if window is not None:
        lo = max(0, query_pos - window + 1)
        if not causal:
            hi = min(hi, query_pos + window)
    return lo, hi


def _check_inputs(q, key_cache, value_cache, slots, start_positions, out, window) -> None:
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
        raise ValueError(f"window: expected None or an int >= 1, got {window!r}")
    if q.dim() != 4 or q.dtype not in (torch.bfloat16, torch.float32) or q.stride(-1) != 1:
        raise ValueError(
            f"q: expected [B, T, H, D] bf16/fp32 with unit stride in D, "
            f"got {tuple(q.shape)} {q.dtype} strides {q.stride()}"
        )
    num_seqs, num_tokens, num_heads, head_dim = q.shape
    if num_seqs < 1 or num_tokens < 1:
        raise ValueError(f"q: expected B >= 1 and T >= 1, got {tuple(q.shape)}")
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(f"q: head dim D must be a power of two in [16, 256], got {head_dim}")
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.dim() != 4 or cache.shape[3] != head_dim or cache.shape != key_cache.shape:
            raise ValueError(
                f"{name}: expected [S, L, Hkv, {head_dim}] like key_cache, got {tuple(cache.shape)}"
            )
        if cache.dtype != q.dtype or cache.device != q.device or not cache.is_contiguous():
            raise ValueError(
                f"{name}: expected contiguous {q.dtype} on {q.device}, "
                f"got {cache.dtype} on {cache.device} (contiguous={cache.is_contiguous()})"
            )
    num_kv_heads = key_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"key_cache: Hkv={num_kv_heads} must divide H={num_heads} of q")
    if num_tokens > key_cache.shape[1]:
        raise ValueError(f"q: T={num_tokens} exceeds the cache length L={key_cache.shape[1]}")
    _check_per_sequence("slots", slots, (torch.int64,), num_seqs, q.device)
    _check_per_sequence(
        "start_positions", start_positions, (torch.int32, torch.int64), num_seqs, q.device
    )
    if out is not None and (
        out.shape != q.shape
        or out.dtype != q.dtype
        or out.device != q.device
        or out.stride(-1) != 1
    ):
        raise ValueError(
            f"out: expected {tuple(q.shape)} {q.dtype} on {q.device} with unit stride in D, "
            f"got {tuple(out.shape)} {out.dtype} on {out.device} strides {out.stride()}"
        )


def _check_per_sequence(name, tensor, dtypes, num_seqs, device) -> None:
    if tensor.shape != (num_seqs,) or tensor.dtype not in dtypes or tensor.device != device:
        raise ValueError(
            f"{name}: expected [{num_seqs}] of {dtypes} on {device}, "
            f"got {tuple(tensor.shape)} {tensor.dtype} on {tensor.device}"
        )
