"""The gated delta rule recurrence for verify/decode (T = 1..16 tokens per sequence) in Triton.

Per token t and value head h (key head h // (Hv // Hk)), in fp32:
q̂ = l2norm(q)·Dk^-0.5, k̂ = l2norm(k);  S ← exp(g)·S;  u = β·(v − Sᵀk̂);  S ← S + k̂ uᵀ;  o = Sᵀq̂.

Why bit-exactness, and not closeness, is the contract. Speculative decoding is lossless only
if the tokens it emits are exactly the tokens the target alone would emit one by one. The
target verifies a block of T drafted tokens in one call, so that call must give, bit for bit,
what T single-token decode steps would give; otherwise a verify could flip an argmax the
target alone would not (and two runs of the same prompt could diverge depending on how many
tokens the drafter proposed). Likewise the batch must not leak into a row: a sequence's result
may not depend on which other sequences share the launch. And a partly rejected block is undone
by replaying its accepted prefix from the committed state (`commit.py`); that replay must land
on exactly the state the accepted tokens alone would have produced, or every later token of the
sequence drifts.

How the kernel guarantees it. One program owns one (sequence, value head, Dv tile) and keeps its
[Dk, BLOCK_V] state tile in registers across the token loop; tokens are applied strictly in
order. The loop bound is a run-time value (`T` and the batch strides, which scale with T, are
never specialised; the replay count is read from memory), so every T, B and replay length runs
the same compiled per-token body. The launch configuration (BLOCK_V, num_warps) depends only on
Dv. Programs share nothing, there are no atomics, every reduction runs over a fixed tile shape,
and FMA contraction is off, so each multiply and add rounds on its own whatever the compiler
schedules around it. The per-token state arithmetic (ops and layouts) is the same whether q/k/v
are bf16 or fp32 and whether outputs are written, so a replay from fp32 copies of bf16 inputs
matches the verify. Hence (a) T tokens in one call equal T one-token calls chained through the
state pool, (b) a row is the same alone or in a batch, and (c) replaying n tokens gives the
state after the first n tokens of a full call, all bit for bit. The state tile is loaded before
and stored after the loop and tiles of different programs are disjoint, so `final_states` may
be `initial_states` (slots must be distinct).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dflash_serve.kernels import is_interpreting, launch_options
from dflash_serve.kernels.jit_math import round_to, wait_for_inputs
from target_service.model.delta_rule import (
    L2_NORM_EPS,
    expand_key_heads,
    gated_delta_rule,
    l2_normalize,
)

# One warp per 128 × 16 state tile. Against 128 × 8 (serving's until 2026-12-01) the commit's
# replay of 8 sequences' prefixes takes half the time and a batch-8 verify-and-commit ~1 ms
# less, batch 1 unchanged (H200: `bench.profile_recurrence` and whole steps,
# bench/results/recurrence-tile-ab-2026-12-01-nvidia-h200.json).
MAX_BLOCK_V = 16
NUM_WARPS = 1


# Triton compiles a variant per specialization key: the arguments that vary from call to call
# (the token count, batch strides, and the index pointers, which the batch commit passes as
# views into one packed tensor at odd offsets) stay out of it, so a new batch mix never
# compiles mid-request (a compile took ~0.1-0.4 s on the H200: the 4-stream stalls).
@triton.jit(
    do_not_specialize=[
        "T",
        "stride_q_b",
        "stride_k_b",
        "stride_v_b",
        "stride_g_b",
        "stride_beta_b",
        "stride_out_b",
    ],
    do_not_specialize_on_alignment=["slots_ptr", "num_tokens_ptr"],
)
def _recurrent_gated_delta_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    initial_ptr,
    final_ptr,
    slots_ptr,
    num_tokens_ptr,
    out_ptr,
    T,
    stride_q_b,
    stride_q_t,
    stride_q_h,
    stride_q_d,
    stride_k_b,
    stride_k_t,
    stride_k_h,
    stride_k_d,
    stride_v_b,
    stride_v_t,
    stride_v_h,
    stride_v_d,
    stride_g_b,
    stride_g_t,
    stride_g_h,
    stride_beta_b,
    stride_beta_t,
    stride_beta_h,
    stride_init_s,
    stride_init_h,
    stride_init_k,
    stride_init_v,
    stride_final_s,
    stride_final_h,
    stride_final_k,
    stride_final_v,
    stride_out_b,
    stride_out_t,
    stride_out_h,
    stride_out_v,
    DK: tl.constexpr,
    DV: tl.constexpr,
    HEADS_PER_KEY: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    SCALE: tl.constexpr,
    EPS: tl.constexpr,
    HAS_NUM_TOKENS: tl.constexpr,
    HAS_OUT: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    wait_for_inputs()
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    v_block = tl.program_id(2)
    key_head = h // HEADS_PER_KEY
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = v_block * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k = offs_k < DK
    mask_v = offs_v < DV
    mask_kv = mask_k[:, None] & mask_v[None, :]

    slot = tl.load(slots_ptr + b)
    init_tile = initial_ptr + slot * stride_init_s + h * stride_init_h
    init_tile += offs_k[:, None] * stride_init_k + offs_v[None, :] * stride_init_v
    state = tl.load(init_tile, mask=mask_kv, other=0.0)

    num_steps = T
    if HAS_NUM_TOKENS:
        num_steps = tl.minimum(tl.maximum(tl.load(num_tokens_ptr + b).to(tl.int32), 0), T)

    q_row = q_ptr + b * stride_q_b + key_head * stride_q_h + offs_k * stride_q_d
    k_row = k_ptr + b * stride_k_b + key_head * stride_k_h + offs_k * stride_k_d
    v_row = v_ptr + b * stride_v_b + h * stride_v_h + offs_v * stride_v_d
    g_at = g_ptr + b * stride_g_b + h * stride_g_h
    beta_at = beta_ptr + b * stride_beta_b + h * stride_beta_h
    out_row = out_ptr + b * stride_out_b + h * stride_out_h + offs_v * stride_out_v
    # Token t + 1's inputs are loaded while token t is computed (they do not depend on the
    # state), hiding the global-memory latency that bounds a short block; the arithmetic of
    # each token is unchanged. The last step re-loads token T - 1 (always in bounds: T >= 1).
    k_next = tl.load(k_row, mask=mask_k, other=0.0)
    v_next = tl.load(v_row, mask=mask_v, other=0.0)
    g_next = tl.load(g_at)
    beta_next = tl.load(beta_at)
    if HAS_OUT:
        q_next = tl.load(q_row, mask=mask_k, other=0.0)
    for t in range(0, num_steps):
        k, v, g, beta = k_next.to(tl.float32), v_next.to(tl.float32), g_next, beta_next
        if HAS_OUT:
            q = q_next.to(tl.float32)
        following = tl.minimum(t + 1, T - 1)
        k_next = tl.load(k_row + following * stride_k_t, mask=mask_k, other=0.0)
        v_next = tl.load(v_row + following * stride_v_t, mask=mask_v, other=0.0)
        g_next = tl.load(g_at + following * stride_g_t)
        beta_next = tl.load(beta_at + following * stride_beta_t)
        if HAS_OUT:
            q_next = tl.load(q_row + following * stride_q_t, mask=mask_k, other=0.0)
        k = k * tl.math.rsqrt(tl.sum(k * k, axis=0) + EPS)
        decay = tl.exp(g)
        state = state * decay
        remembered = tl.sum(state * k[:, None], axis=0)
        delta = (v - remembered) * beta
        state = state + k[:, None] * delta[None, :]
        if HAS_OUT:
            q = q * tl.math.rsqrt(tl.sum(q * q, axis=0) + EPS) * SCALE
            o = tl.sum(state * q[:, None], axis=0)
            o = round_to(o, out_ptr.dtype.element_ty, INTERPRETED)
            tl.store(out_row + t * stride_out_t, o, mask=mask_v)

    final_tile = final_ptr + slot * stride_final_s + h * stride_final_h
    final_tile += offs_k[:, None] * stride_final_k + offs_v[None, :] * stride_final_v
    tl.store(final_tile, state, mask=mask_kv)


def recurrent_gated_delta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_states: torch.Tensor,
    final_states: torch.Tensor,
    slots: torch.Tensor,
    num_tokens: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    launch: tuple[int, int] | None = None,
) -> None:
    """Advance the states of `slots` over a block of tokens; write outputs to `out` if given.

    q, k [B, T, Hk, Dk] raw (after conv + SiLU, before l2 norm), bf16 or fp32; v [B, T, Hv, Dv]
    bf16 or fp32; g (log decay, ≤ 0) and beta [B, T, Hv] fp32; initial_states and final_states
    [S, Hv, Dk, Dv] fp32 state pools (may be the same tensor); slots [B] int64, distinct;
    num_tokens [B] int32 (clamped to 0..T): only the first num_tokens[b] tokens of row b are
    applied and written, None = all T; out [B, T, Hv, Dv] fp32 or bf16 (each output computed
    in fp32 and rounded once, as `.to(torch.bfloat16)` would), or None to write no outputs
    (replay). Rows beyond num_tokens[b] in `out` and slots not in `slots` are left untouched.
    No host sync and no allocation (T = 0 only copies the states, through a gather): safe
    to capture in a CUDA graph. launch: (BLOCK_V, num_warps) instead of the configuration
    every serving call uses (for `bench.profile_recurrence`; results may differ in the last
    bits between configurations, never between calls of one).
    """
    _check_arguments(q, k, v, g, beta, initial_states, final_states, slots, num_tokens, out)
    num_seqs, num_steps, num_key_heads, key_dim = q.shape
    if num_steps == 0:  # nothing to apply (and no token 0 for the kernel's first load)
        final_states[slots] = initial_states[slots]
        return
    num_value_heads, value_dim = v.shape[2], v.shape[3]
    block_v, num_warps = launch or (min(triton.next_power_of_2(value_dim), MAX_BLOCK_V), NUM_WARPS)
    grid = (num_seqs, num_value_heads, triton.cdiv(value_dim, block_v))
    out_strides = out.stride() if out is not None else (0, 0, 0, 0)
    _recurrent_gated_delta_kernel[grid](
        q,
        k,
        v,
        g,
        beta,
        initial_states,
        final_states,
        slots,
        num_tokens if num_tokens is not None else slots,
        out if out is not None else final_states,
        num_steps,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *g.stride(),
        *beta.stride(),
        *initial_states.stride(),
        *final_states.stride(),
        *out_strides,
        DK=key_dim,
        DV=value_dim,
        HEADS_PER_KEY=num_value_heads // num_key_heads,
        BLOCK_K=triton.next_power_of_2(key_dim),
        BLOCK_V=block_v,
        SCALE=key_dim**-0.5,
        EPS=L2_NORM_EPS,
        HAS_NUM_TOKENS=num_tokens is not None,
        HAS_OUT=out is not None,
        INTERPRETED=is_interpreting(),
        num_warps=num_warps,
        **launch_options(fp_fusion=False),
    )


def recurrent_gated_delta_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_states: torch.Tensor,
    final_states: torch.Tensor,
    slots: torch.Tensor,
    num_tokens: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> None:
    """Plain-torch fp32 version of `recurrent_gated_delta` (same arguments and effects)."""
    _check_arguments(q, k, v, g, beta, initial_states, final_states, slots, num_tokens, out)
    num_value_heads, key_dim = v.shape[2], q.shape[3]
    q = expand_key_heads(l2_normalize(q) * key_dim**-0.5, num_value_heads)
    k = expand_key_heads(l2_normalize(k), num_value_heads)
    v = v.float()
    initial = initial_states[slots]
    for row in range(q.shape[0]):
        n = q.shape[1] if num_tokens is None else max(0, min(int(num_tokens[row]), q.shape[1]))
        rows = slice(row, row + 1)
        outputs, state = gated_delta_rule(
            q[rows, :n], k[rows, :n], v[rows, :n], g[rows, :n], beta[rows, :n], initial[rows]
        )
        final_states[slots[row]] = state[0]
        if out is not None:
            out[row, :n] = outputs[0]


def _check_arguments(q, k, v, g, beta, initial_states, final_states, slots, num_tokens, out):
    if q.dim() != 4 or q.shape[0] == 0:
        raise ValueError(f"q must be [B >= 1, T, Hk, Dk], got {tuple(q.shape)}")
    num_seqs, num_steps, num_key_heads, key_dim = q.shape
    if v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"v must be [B={num_seqs}, T={num_steps}, Hv, Dv], got {tuple(v.shape)}")
    num_value_heads, value_dim = v.shape[2], v.shape[3]
    if num_value_heads % num_key_heads != 0:
        raise ValueError(f"v heads ({num_value_heads}) must be a multiple of q/k heads")
    state_shape = (num_value_heads, key_dim, value_dim)
    expected = {
        "k": (tuple(q.shape), (torch.bfloat16, torch.float32)),
        "g": ((num_seqs, num_steps, num_value_heads), (torch.float32,)),
        "beta": ((num_seqs, num_steps, num_value_heads), (torch.float32,)),
        "slots": ((num_seqs,), (torch.int64,)),
        "num_tokens": ((num_seqs,), (torch.int32,)),
        "out": ((num_seqs, num_steps, num_value_heads, value_dim), (torch.float32, torch.bfloat16)),
    }
    named = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "slots": slots}
    named |= {"initial_states": initial_states, "final_states": final_states}
    named |= {"num_tokens": num_tokens, "out": out}
    for name, (shape, dtypes) in expected.items():
        tensor = named[name]
        if tensor is not None and (tuple(tensor.shape) != shape or tensor.dtype not in dtypes):
            raise ValueError(
                f"{name} must be {list(shape)} {dtypes}, got {list(tensor.shape)} {tensor.dtype}"
            )
    for name in ("q", "v"):
        if named[name].dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"{name} must be bf16 or fp32, got {named[name].dtype}")
    for name in ("initial_states", "final_states"):
        pool = named[name]
        if pool.dim() != 4 or tuple(pool.shape[1:]) != state_shape or pool.dtype != torch.float32:
            raise ValueError(
                f"{name} must be [S, {', '.join(map(str, state_shape))}] fp32, "
                f"got {list(pool.shape)} {pool.dtype}"
            )
    if final_states.shape[0] != initial_states.shape[0]:
        raise ValueError(
            f"final_states has {final_states.shape[0]} slots, "
            f"initial_states {initial_states.shape[0]}"
        )
    for name, tensor in named.items():
        if tensor is not None and tensor.device != q.device:
            raise ValueError(f"{name} is on {tensor.device}, q on {q.device}")
