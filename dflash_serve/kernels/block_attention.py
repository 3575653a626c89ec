"""Attention of a block of T new tokens per sequence over a slotted KV cache (GQA).

The target's verify/decode step (causal, no window) and the drafter's draft step (its layers'
causal and sliding-window rules) both attend this way: the block's own keys/values are already
written into the cache at positions start .. start + T − 1 of each sequence's slot.

Split-KV ("flash-decoding"): a block of 16 tokens has too few query rows to fill the GPU with
one program per (sequence, kv head), so the cache is cut into fixed chunks of SPLIT_KEYS
positions, chunk s = [s·SPLIT_KEYS, (s + 1)·SPLIT_KEYS), and two kernels run:
- a split program owns one sequence, one kv head and a tile of up to `tile_tokens` block
  tokens; its BLOCK_M rows are the (token, query head of the group) pairs, row r = token r // G,
  head r % G, so the group's queries share every key/value tile they load (rows past the block
  are padding). Of the chunks its rows see it takes every P-th (P programs share a tile), runs
  the online softmax over each chunk's BLOCK_N key blocks from the empty state and writes each
  row's unnormalised fp32 partial (accumulator, running max m, sum l) to a scratch buffer
  [B, T, H, num_splits, ·]. Chunks no row of the tile sees are neither computed nor written;
- a combine program owns one (sequence, token, kv head group) and merges, in increasing chunk
  order, exactly the chunks that overlap the token's visible key range (so it never reads an
  unwritten partial), then divides by l and rounds to the output dtype (given a gate, then
  times its sigmoid: Qwen3.5's gated output, rounded op for op as torch's ops round it).
num_splits = cdiv(L, SPLIT_KEYS) and P = min(num_splits, cdiv(min_programs, B·Hkv·tiles)) come
from shapes, so the launch depends on shapes only (graph-capturable, no host sync). P, not
num_splits, sizes the grid: a cache sized for the longest context would otherwise launch mostly
programs with no chunk to compute, each holding a multiprocessor while it starts and exits.

Row independence (lossless speculative decoding needs it): a query's output is bit-identical
whatever T, B, L or tile row it lands in, because
- the launch configuration (tiles, BLOCK_N, SPLIT_KEYS, warps) depends only on (H, Hkv, D) and
  the visibility rule, never on T, B or L; P, which does, only decides which program computes
  a chunk, and every chunk starts from the empty state;
- chunks and the key blocks inside them start at fixed positions (multiples of SPLIT_KEYS and of
  BLOCK_N, which divides SPLIT_KEYS) for every row and every call, so a row meets the same key
  tiles, grouped into the same chunks, in the same order with the same per-element arithmetic;
- a split program loops over the union of its rows' key ranges within a chunk, and a block
  entirely masked for a row leaves that row's m, l and accumulator bit-for-bit unchanged: every
  score is −inf, so max(m, −inf) = m, the rescale factor is exp2(m − m) = exp2(0) = 1 exactly,
  every p = exp2(−inf) = 0 exactly, and l·1 + 0 = l, acc·1 + (P·V = 0) = acc. A row whose max is
  still −inf (padding, or no key seen yet) subtracts 0 instead of −inf, since −inf − (−inf) is
  NaN. So which masked blocks a program visits (a window skips the blocks before its first row's
  range) does not change any row's partial of a chunk;
- the chunks a row's combine reads, and their order, follow from the row's own visible range
  alone; how many chunks exist beyond it (L) or which program wrote them does not matter. The
  merge applies the same −inf rule, so an empty partial (m = −inf, l = 0, acc = 0) would be an
  exact no-op too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dflash_serve.kernels import is_interpreting, launch_options
from dflash_serve.kernels.jit_math import round_to, sigmoid_in, wait_for_inputs
from dflash_serve.layers.attention import attend_each_query

# A full speculative block (anchor + 15 drafts) is one tile when the group allows it.
MAX_TILE_TOKENS = 16
MAX_ROWS_PER_TILE = 64
LOG2E = math.log2(math.e)
# On an H200 (T = 16 over 528 and 2016 keys; B = 1, 4, 16) 256 was within 6 µs of 64 and 128
# at B <= 4 and the fastest at B = 16, where the partials' bytes weigh most.
SPLIT_KEYS = 256
# A launch aims at two split programs per multiprocessor of the GPU we serve on.
H200_NUM_SMS = 132
# One combine program holds a group's [G, D] fp32 accumulator (4 × 256 for Qwen3.5-4B).
COMBINE_NUM_WARPS = 4


@dataclass(frozen=True)
class LaunchConfig:
    """The one launch configuration of a head shape; nothing in it depends on T, B or L.

    `split_keys` (the chunk of cache positions one partial covers) is a multiple of `block_n`,
    so chunk boundaries fall on key-block boundaries. `min_programs` only sets how many split
    programs share a tile's chunks (never what any chunk computes), so it may change freely.
    """

    tile_tokens: int
    block_m: int
    block_n: int
    split_keys: int
    num_warps: int
    num_stages: int
    min_programs: int = 2 * H200_NUM_SMS


def launch_config(num_heads: int, num_kv_heads: int, head_dim: int) -> LaunchConfig:
    """Up to 16 tokens × the group per tile (64 rows = 16 × 4 for Qwen3.5-4B).

    Wide heads take narrower key tiles and more warps to keep the fp32 accumulator in registers.
    Chunks of SPLIT_KEYS positions: smaller chunks spread a short batch over more programs, but
    every chunk a row sees costs a [D] fp32 partial written and read back, which outweighs the
    keys' own bytes once the batch alone fills the GPU.
    """
    group = num_heads // num_kv_heads
    tile_tokens = max(1, min(MAX_TILE_TOKENS, MAX_ROWS_PER_TILE // group))
    block_m = max(16, triton.next_power_of_2(tile_tokens * group))
    if head_dim <= 64:
        block_n, num_warps = 64, 4
    elif head_dim <= 128:
        block_n, num_warps = 64, 8
    else:
        block_n, num_warps = 32, 8
    return LaunchConfig(
        tile_tokens,
        block_m,
        block_n=block_n,
        split_keys=SPLIT_KEYS,
        num_warps=num_warps,
        num_stages=2,
    )


@triton.jit
def _visible_range(
    query_pos, block_end, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, WINDOW: tl.constexpr
):
    """The key positions [lo, hi) a query at `query_pos` sees, as `visible_range` says; `hi` is
    shaped like `query_pos`, `lo` too when there is a window (else it is the scalar 0).

    Both bounds are non-decreasing in `query_pos`, so a tile's first and last tokens give the
    union of its rows' ranges.
    """
    lo = 0
    hi = query_pos + 1 if IS_CAUSAL else block_end + 0 * query_pos
    if HAS_WINDOW:
        lo = tl.maximum(query_pos - WINDOW + 1, 0)
        if not IS_CAUSAL:
            hi = tl.minimum(hi, query_pos + WINDOW)
    return lo, hi


@triton.jit
def _partial_index(seq, tokens, heads, chunk, num_tokens, num_heads, num_splits):
    """Flat index of (b, t, h, chunk) in the contiguous [B, T, H, num_splits] partials (int64)."""
    row = (seq * num_tokens + tokens) * num_heads + heads
    return row.to(tl.int64) * num_splits + chunk


# Value-specialising T, L or the strides and counts derived from them (and B) could compile a
# different kernel per T, B or L.
# Index pointers (slots, starts) may be views at any offset: `ForwardBatch.on_device` and the
# drafter keep both in one [2, B] tensor, so the starts are 16-byte aligned only for even B;
# specialised on alignment, odd and even batches compiled separate variants mid-request.
INDEX_POINTERS = ["slots_ptr", "starts_ptr"]


@triton.jit(
    do_not_specialize=[
        "num_tokens",
        "cache_len",
        "num_splits",
        "num_split_programs",
        "q_stride_b",
        "q_stride_t",
    ],
    do_not_specialize_on_alignment=INDEX_POINTERS,
)
def _split_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    slots_ptr,
    starts_ptr,
    num_tokens,
    cache_len,
    num_splits,
    num_split_programs,
    num_kv_heads,
    q_stride_b,
    q_stride_t,
    q_stride_h,
    cache_stride_slot,
    cache_stride_pos,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    TILE_TOKENS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_KEYS: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    WINDOW: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    wait_for_inputs()
    seq = tl.program_id(1) // num_kv_heads
    kv_head = tl.program_id(1) % num_kv_heads
    first_token = tl.program_id(2) * TILE_TOKENS
    last_token = tl.minimum(num_tokens, first_token + TILE_TOKENS) - 1

    start = tl.load(starts_ptr + seq).to(tl.int32)
    block_end = start + num_tokens
    program_start, _ = _visible_range(start + first_token, block_end, IS_CAUSAL, HAS_WINDOW, WINDOW)
    _, program_end = _visible_range(start + last_token, block_end, IS_CAUSAL, HAS_WINDOW, WINDOW)
    # Aligned down to BLOCK_N (which divides SPLIT_KEYS): the key blocks stay at the same
    # positions for every row.
    loop_start = program_start // BLOCK_N * BLOCK_N
    # The chunks some row of the tile sees; this program takes every num_split_programs-th.
    # The clamp only keeps a caller's broken start + T <= L inside the partials.
    first_chunk = program_start // SPLIT_KEYS + tl.program_id(0)
    last_chunk = tl.minimum((program_end - 1) // SPLIT_KEYS, num_splits - 1)
    if first_chunk > last_chunk:
        return
    load_end = tl.minimum(program_end, cache_len)

    rows = tl.arange(0, BLOCK_M)
    tokens = first_token + rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    is_row = (rows < TILE_TOKENS * GROUP) & (tokens < num_tokens)
    dims = tl.arange(0, HEAD_DIM)
    row_starts, row_ends = _visible_range(start + tokens, block_end, IS_CAUSAL, HAS_WINDOW, WINDOW)
    row_ends = tl.where(is_row, row_ends, 0)
    partial_rows = _partial_index(
        seq, tokens, heads, 0, num_tokens, num_kv_heads * GROUP, num_splits
    )

    q_rows = seq * q_stride_b + tokens * q_stride_t + heads * q_stride_h
    q = tl.load(q_ptr + q_rows[:, None] + dims[None, :], mask=is_row[:, None], other=0.0)
    if DOT_IN_FP32:
        q = q.to(tl.float32)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    cache_base = slot * cache_stride_slot + kv_head * HEAD_DIM

    for chunk in range(first_chunk, last_chunk + 1, num_split_programs):
        # Each chunk starts from the empty state, so its partial does not depend on which
        # program computes it or on the chunks before it.
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        keys_start = tl.maximum(loop_start, chunk * SPLIT_KEYS)
        keys_end = tl.minimum(program_end, (chunk + 1) * SPLIT_KEYS)
        for block_start in range(keys_start, keys_end, BLOCK_N):
            keys_pos = block_start + tl.arange(0, BLOCK_N)
            is_loaded = keys_pos < load_end
            if HAS_WINDOW:
                is_loaded = is_loaded & (keys_pos >= program_start)
            kv_offsets = cache_base + keys_pos * cache_stride_pos
            k_t = tl.load(
                k_ptr + kv_offsets[None, :] + dims[:, None], mask=is_loaded[None, :], other=0.0
            )
            v = tl.load(
                v_ptr + kv_offsets[:, None] + dims[None, :], mask=is_loaded[:, None], other=0.0
            )
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

        partial = partial_rows + chunk
        tl.store(partial_max_ptr + partial, m_i, mask=is_row)
        tl.store(partial_sum_ptr + partial, l_i, mask=is_row)
        tl.store(
            partial_out_ptr + partial[:, None] * HEAD_DIM + dims[None, :],
            acc,
            mask=is_row[:, None],
        )


@triton.jit(
    do_not_specialize=[
        "num_tokens",
        "num_splits",
        "o_stride_b",
        "o_stride_t",
        "g_stride_b",
        "g_stride_t",
    ],
    do_not_specialize_on_alignment=INDEX_POINTERS,
)
def _combine_splits_kernel(
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    out_ptr,
    gate_ptr,
    starts_ptr,
    num_tokens,
    num_splits,
    o_stride_b,
    o_stride_t,
    o_stride_h,
    g_stride_b,
    g_stride_t,
    g_stride_h,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    SPLIT_KEYS: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    WINDOW: tl.constexpr,
    HAS_GATE: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """One (kv head, token, sequence): the group's chunks merged, then (HAS_GATE) times
    σ(gate) as torch computes `attn * sigmoid(gate)` in the output dtype, op for op."""
    wait_for_inputs()
    kv_head = tl.program_id(0)
    token = tl.program_id(1)
    seq = tl.program_id(2)
    group_rows = tl.arange(0, BLOCK_G)
    is_row = group_rows < GROUP
    heads = kv_head * GROUP + group_rows
    dims = tl.arange(0, HEAD_DIM)

    # The group's heads share the token, hence its visible range and its chunks.
    start = tl.load(starts_ptr + seq).to(tl.int32)
    lo, hi = _visible_range(start + token, start + num_tokens, IS_CAUSAL, HAS_WINDOW, WINDOW)
    # The chunks overlapping [lo, hi): each holds a key the rows see, so a split program wrote
    # them. The clamp only keeps a caller's broken start + T <= L inside the partials.
    first_chunk = lo // SPLIT_KEYS
    last_chunk = tl.minimum((hi - 1) // SPLIT_KEYS, num_splits - 1)
    num_heads = tl.num_programs(0) * GROUP
    first_partial = _partial_index(seq, token, heads, 0, num_tokens, num_heads, num_splits)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    # Fixed increasing order: the same chunks in the same order for a row in every call.
    for chunk in range(first_chunk, last_chunk + 1):
        partial = first_partial + chunk
        m_chunk = tl.load(partial_max_ptr + partial, mask=is_row, other=float("-inf"))
        l_chunk = tl.load(partial_sum_ptr + partial, mask=is_row, other=0.0)
        acc_chunk = tl.load(
            partial_out_ptr + partial[:, None] * HEAD_DIM + dims[None, :],
            mask=is_row[:, None],
            other=0.0,
        )
        m_new = tl.maximum(m_i, m_chunk)
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_base)
        beta = tl.exp2(m_chunk - m_base)
        l_i = l_i * alpha + l_chunk * beta
        acc = acc * alpha[:, None] + acc_chunk * beta[:, None]
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out_dtype = out_ptr.dtype.element_ty
    if HAS_GATE:  # attn rounded as the ungated store rounds it, then the product rounded
        gate_rows = seq * g_stride_b + token * g_stride_t + heads * g_stride_h
        gate = tl.load(gate_ptr + gate_rows[:, None] + dims[None, :], mask=is_row[:, None])
        attn = out.to(out_dtype).to(tl.float32)
        gated = attn * sigmoid_in(gate.to(tl.float32), out_dtype, INTERPRETED)
        out = round_to(gated, out_dtype, INTERPRETED)
    out_rows = seq * o_stride_b + token * o_stride_t + heads * o_stride_h
    tl.store(out_ptr + out_rows[:, None] + dims[None, :], out.to(out_dtype), mask=is_row[:, None])


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
    config: LaunchConfig | None = None,
    gate: torch.Tensor | None = None,
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
    Graph-capturable: the launch depends on shapes only; it allocates an fp32 scratch of
    B·T·H·cdiv(L, split_keys)·(D + 2) values. fp32 inputs always take the IEEE fp32 dot (the
    default TF32 would lose precision). `config` defaults to `launch_config` of the head shape;
    bit-exact row independence holds between calls with the same config.
    gate: optional [B, T, H, D] of q's dtype (any strides, unit in D): the output is then
    `attn * activations.sigmoid(gate)`, bit for bit torch's five launches for it on the GPU
    (Qwen3.5's gated attention output), in the combine kernel.
    """
    _check_inputs(q, key_cache, value_cache, slots, start_positions, out, window)
    _check_like_output("gate", gate, q)
    num_seqs, num_tokens, num_heads, head_dim = q.shape
    cache_len, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    if config is None:
        config = launch_config(num_heads, num_kv_heads, head_dim)
    _check_config(config, group)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_splits = triton.cdiv(cache_len, config.split_keys)
    stats_shape = (num_seqs, num_tokens, num_heads, num_splits)
    partial_out = torch.empty((*stats_shape, head_dim), dtype=torch.float32, device=q.device)
    partial_max = torch.empty(stats_shape, dtype=torch.float32, device=q.device)
    partial_sum = torch.empty(stats_shape, dtype=torch.float32, device=q.device)
    rule = dict(
        IS_CAUSAL=bool(causal),
        HAS_WINDOW=window is not None,
        WINDOW=0 if window is None else int(window),
    )
    num_tiles = triton.cdiv(num_tokens, config.tile_tokens)
    num_tile_programs = num_seqs * num_kv_heads * num_tiles
    num_split_programs = min(num_splits, triton.cdiv(config.min_programs, num_tile_programs))
    _split_attention_kernel[(num_split_programs, num_seqs * num_kv_heads, num_tiles)](
        q,
        key_cache,
        value_cache,
        partial_out,
        partial_max,
        partial_sum,
        slots,
        start_positions,
        num_tokens,
        cache_len,
        num_splits,
        num_split_programs,
        num_kv_heads,
        *q.stride()[:3],
        key_cache.stride(0),
        key_cache.stride(1),
        scale * LOG2E,
        HEAD_DIM=head_dim,
        GROUP=group,
        TILE_TOKENS=config.tile_tokens,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        SPLIT_KEYS=config.split_keys,
        DOT_IN_FP32=is_interpreting() or q.dtype == torch.float32,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **launch_options(),
        **rule,
    )
    gate_or_out = out if gate is None else gate  # (never read without HAS_GATE)
    _combine_splits_kernel[(num_kv_heads, num_tokens, num_seqs)](
        partial_out,
        partial_max,
        partial_sum,
        out,
        gate_or_out,
        start_positions,
        num_tokens,
        num_splits,
        *out.stride()[:3],
        *gate_or_out.stride()[:3],
        HEAD_DIM=head_dim,
        GROUP=group,
        BLOCK_G=triton.next_power_of_2(group),
        SPLIT_KEYS=config.split_keys,
        HAS_GATE=gate is not None,
        INTERPRETED=is_interpreting(),
        num_warps=COMBINE_NUM_WARPS,
        **launch_options(),
        **rule,
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
    _check_like_output("out", out, q)


def _check_like_output(name: str, tensor: torch.Tensor | None, q: torch.Tensor) -> None:
    """`out` and `gate`: optional, q's shape, dtype and device, unit stride in D."""
    if tensor is not None and (
        tensor.shape != q.shape
        or tensor.dtype != q.dtype
        or tensor.device != q.device
        or tensor.stride(-1) != 1
    ):
        raise ValueError(
            f"{name}: expected {tuple(q.shape)} {q.dtype} on {q.device} with unit stride in D, "
            f"got {tuple(tensor.shape)} {tensor.dtype} on {tensor.device} "
            f"strides {tensor.stride()}"
        )


def _check_config(config: LaunchConfig, group: int) -> None:
    if config.tile_tokens < 1 or config.block_m < config.tile_tokens * group:
        raise ValueError(
            f"config: expected tile_tokens >= 1 and block_m >= tile_tokens × group "
            f"({config.tile_tokens} × {group}), got {config}"
        )
    if config.block_n < 16 or config.split_keys < 1 or config.split_keys % config.block_n:
        raise ValueError(
            f"config: expected block_n >= 16 and split_keys a multiple of block_n, got {config}"
        )
    if config.min_programs < 1:
        raise ValueError(f"config: expected min_programs >= 1, got {config}")


def _check_per_sequence(name, tensor, dtypes, num_seqs, device) -> None:
    if tensor.shape != (num_seqs,) or tensor.dtype not in dtypes or tensor.device != device:
        raise ValueError(
            f"{name}: expected [{num_seqs}] of {dtypes} on {device}, "
            f"got {tuple(tensor.shape)} {tensor.dtype} on {tensor.device}"
        )
