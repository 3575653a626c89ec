"""Everything a Gated DeltaNet layer does between its input projections and the recurrence.

On the verify path the conv over the conv state, SiLU, the decay and beta gates and the copies
that `commit` replays from were some 25 small torch kernels per layer; here they are one
launch. Per sequence b, token t and channel c, with W the conv width:

  x_j  = conv_states[slots[b], c, t + j]              if t + j − (W−1) < 0 (the W−1 inputs
         conv_inputs[b, t + j − (W−1), c]             before the block), else the block's own;
  conv_out[b, t, c] = silu(Σ_j w[c, j]·x_j), summed in fp32 for j = 0..W−1, rounded once;
  decay[b, t, h] = −exp(A_log[h])·softplus(a[b, t, h] + dt_bias[h]);  beta = sigmoid(b), fp32;

and the block record at [slots[b], t]: the pre-conv input, the k and v channels of conv_out
(exactly the rounded values, as fp32, so a replay sees what the verify saw), decay and beta.
The conv state itself is left alone: `commit` advances it by the tokens it keeps.
`prepare_gdn_prefill_inputs` is the same launch without the block record, for a prefill
chunk of any length (there some 20 torch kernels per layer each streamed the whole chunk).

Row independence: one program computes one token's channel block from loads alone, nothing is
shared between programs, FMA contraction is off, and the block sizes and warps depend on C and
Hv only, so a token's results are bit for bit the same alone, in a 16-token block or in a
batch. The activations follow `dflash_serve.layers.activations` op for op, with IEEE division
and, on the GPU, libdevice's exp/log1p (the interpreter has no libdevice: numpy's exp, and
log1p from log by the compensated formula log(u)·y/(u−1), u = 1+y).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from dflash_serve.kernels import is_interpreting, launch_options
from dflash_serve.kernels.jit_math import (
    exact_exp,
    load_summed,
    round_to,
    sigmoid_in,
    wait_for_inputs,
)
from dflash_serve.layers.activations import SOFTPLUS_THRESHOLD, sigmoid, silu, softplus
from dflash_serve.layers.split_sums import SplitSums, kernel_operand, materialized

SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)
MAX_BLOCK_C = 1024
NUM_WARPS = 4


@triton.jit
def _log1p(y, INTERPRETED: tl.constexpr):
    if INTERPRETED:
        u = 1.0 + y
        is_tiny = u == 1.0
        return tl.where(is_tiny, y, tl.log(u) * tl.div_rn(y, tl.where(is_tiny, 1.0, u - 1.0)))
    return libdevice.log1p(y)


@triton.jit
def _tap(
    x_at, stride_x_t, state_at, stride_state_w, weight_at, stride_weight_w, t, mask,
    j: tl.constexpr, W: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """w_j · x_j in fp32; x_j is the pre-conv input at t + j − (W−1), from the state if < 0."""
    pos = t + j - (W - 1)
    if pos < 0:
        x = tl.load(state_at + (t + j) * stride_state_w, mask=mask, other=0.0).to(tl.float32)
        x = round_to(x, x_at.dtype.element_ty, INTERPRETED).to(tl.float32)
    else:
        x = tl.load(x_at + pos * stride_x_t, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(weight_at + j * stride_weight_w, mask=mask, other=0.0)
    return x * w.to(tl.float32)


@triton.jit(
    do_not_specialize=[
        "T",
        "stride_x_b",
        "stride_out_b",
        "stride_a_b",
        "stride_b_b",
        "stride_decay_b",
        "stride_beta_b",
        "gate_split_stride",
    ]
)
def _gdn_inputs_kernel(
    x_ptr, a_ptr, b_ptr, state_ptr, weight_ptr, a_log_ptr, dt_bias_ptr, slots_ptr,
    out_ptr, decay_ptr, beta_ptr,
    rec_x_ptr, rec_k_ptr, rec_v_ptr, rec_decay_ptr, rec_beta_ptr,
    T, gate_split_stride,
    stride_x_b, stride_x_t, stride_a_b, stride_a_t, stride_b_b, stride_b_t,
    stride_state_s, stride_state_c, stride_state_w, stride_weight_c, stride_weight_w,
    stride_out_b, stride_out_t, stride_decay_b, stride_decay_t, stride_beta_b, stride_beta_t,
    stride_rec_x_s, stride_rec_x_t, stride_rec_k_s, stride_rec_k_t,
    stride_rec_v_s, stride_rec_v_t, stride_rec_decay_s, stride_rec_decay_t,
    stride_rec_beta_s, stride_rec_beta_t,
    C: tl.constexpr, KEY_DIM: tl.constexpr, HV: tl.constexpr, W: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr, THRESHOLD: tl.constexpr,
    RECORD: tl.constexpr, GATE_SPLITS: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """GATE_SPLITS > 0: a and b are a matmul's split-K partial sums, split s at
    s·gate_split_stride, added here as `sum_splits` adds them (`load_summed`)."""
    wait_for_inputs()
    row = tl.program_id(0).to(tl.int64)
    seq = row // T
    t = row % T
    slot = tl.load(slots_ptr + seq)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = cols < C

    x_at = x_ptr + seq * stride_x_b + cols
    state_at = state_ptr + slot * stride_state_s + cols * stride_state_c
    weight_at = weight_ptr + cols * stride_weight_c
    conv = _tap(
        x_at, stride_x_t, state_at, stride_state_w, weight_at, stride_weight_w, t, mask,
        0, W, INTERPRETED,
    )  # fmt: skip
    for j in tl.static_range(1, W):
        conv = conv + _tap(
            x_at, stride_x_t, state_at, stride_state_w, weight_at, stride_weight_w, t, mask,
            j, W, INTERPRETED,
        )  # fmt: skip
    out = round_to(
        conv * sigmoid_in(conv, tl.float32, INTERPRETED), out_ptr.dtype.element_ty, INTERPRETED
    )
    tl.store(out_ptr + seq * stride_out_b + t * stride_out_t + cols, out, mask=mask)

    if RECORD:
        x = tl.load(x_at + t * stride_x_t, mask=mask).to(tl.float32)
        rec_x = round_to(x, rec_x_ptr.dtype.element_ty, INTERPRETED)
        tl.store(rec_x_ptr + slot * stride_rec_x_s + t * stride_rec_x_t + cols, rec_x, mask=mask)
        out = out.to(tl.float32)
        is_key = (cols >= KEY_DIM) & (cols < 2 * KEY_DIM)
        rec_k_at = rec_k_ptr + slot * stride_rec_k_s + t * stride_rec_k_t + (cols - KEY_DIM)
        tl.store(rec_k_at, out, mask=mask & is_key)
        rec_v_at = rec_v_ptr + slot * stride_rec_v_s + t * stride_rec_v_t + (cols - 2 * KEY_DIM)
        tl.store(rec_v_at, out, mask=mask & (cols >= 2 * KEY_DIM))

    if tl.program_id(1) == 0:
        heads = tl.arange(0, BLOCK_H)
        mask_h = heads < HV
        a_offs = seq * stride_a_b + t * stride_a_t + heads
        a = load_summed(a_ptr, a_offs, mask_h, gate_split_stride, GATE_SPLITS, INTERPRETED)
        b_offs = seq * stride_b_b + t * stride_b_t + heads
        b = load_summed(b_ptr, b_offs, mask_h, gate_split_stride, GATE_SPLITS, INTERPRETED)
        a_log = tl.load(a_log_ptr + heads, mask=mask_h, other=0.0)
        dt_bias = tl.load(dt_bias_ptr + heads, mask=mask_h, other=0.0)
        g = a + dt_bias
        # exp of min(g, THRESHOLD): where softplus(g) = g the log1p branch is discarded anyway.
        log_term = _log1p(exact_exp(tl.minimum(g, THRESHOLD), INTERPRETED), INTERPRETED)
        decay = -exact_exp(a_log, INTERPRETED) * tl.where(g > THRESHOLD, g, log_term)
        beta = sigmoid_in(b, tl.float32, INTERPRETED)
        tl.store(decay_ptr + seq * stride_decay_b + t * stride_decay_t + heads, decay, mask=mask_h)
        tl.store(beta_ptr + seq * stride_beta_b + t * stride_beta_t + heads, beta, mask=mask_h)
        if RECORD:
            rec_decay_at = rec_decay_ptr + slot * stride_rec_decay_s + t * stride_rec_decay_t
            tl.store(rec_decay_at + heads, decay, mask=mask_h)
            rec_beta_at = rec_beta_ptr + slot * stride_rec_beta_s + t * stride_rec_beta_t
            tl.store(rec_beta_at + heads, beta, mask=mask_h)


def prepare_gdn_inputs(
    conv_inputs: torch.Tensor,
    a: torch.Tensor | SplitSums,
    b: torch.Tensor | SplitSums,
    conv_states: torch.Tensor,
    conv_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    slots: torch.Tensor,
    key_dim: int,
    conv_out: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
    block_conv_inputs: torch.Tensor,
    block_keys: torch.Tensor,
    block_values: torch.Tensor,
    block_decays: torch.Tensor,
    block_betas: torch.Tensor,
) -> None:
    """Conv + SiLU, gates and the block record of one GDN layer, for B sequences of T tokens.
    a and b may be a bf16 matmul's result left as split-K partial sums (`SplitSums` column
    slices of one matmul): summed here bit for bit as `sum_splits` sums them, which saves its
    launch. (Not the conv inputs: their four taps would read each partial four times, which
    measured slower at 8 verify blocks than the sum's launch.)

    conv_inputs [B, T, C] bf16/fp32 (channels: q [0, key_dim), k [key_dim, 2·key_dim), v the
    rest); a, b [B, T, Hv] of conv_inputs' dtype; conv_states [S, C, W−1] (oldest first, any
    supported dtype, read through conv_inputs' dtype), conv_weight [C, W] (any strides);
    A_log, dt_bias [Hv] fp32; slots [B] int64, distinct. Outputs: conv_out [B, T, C] of
    conv_inputs' dtype; decay, beta [B, T, Hv] fp32; at [slots[b], t] for t < T of the pools
    block_conv_inputs [S, Tmax, C] (its own dtype), block_keys [S, Tmax, key_dim] and
    block_values [S, Tmax, C − 2·key_dim] fp32, block_decays and block_betas [S, Tmax, Hv] fp32.
    Every tensor but conv_states and conv_weight needs a unit last stride (views are fine).
    Nothing else is written. No host sync, no allocation: safe to capture in a CUDA graph.
    """
    _check_arguments(**locals())
    records = (block_conv_inputs, block_keys, block_values, block_decays, block_betas)
    _launch(conv_inputs, a, b, conv_states, conv_weight, A_log, dt_bias, slots, conv_out, decay,
            beta, records, key_dim)  # fmt: skip


def prepare_gdn_prefill_inputs(
    conv_inputs: torch.Tensor,
    a: torch.Tensor | SplitSums,
    b: torch.Tensor | SplitSums,
    conv_states: torch.Tensor,
    conv_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    slots: torch.Tensor,
    conv_out: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
) -> None:
    """`prepare_gdn_inputs` for a prefill chunk of any length: the same conv + SiLU and gates,
    bit for bit, and no block record (prefill commits as it goes; the caller advances the conv
    state after this call, which reads it). Arguments as there."""
    _check_conv_and_gates(**locals())
    _launch(conv_inputs, a, b, conv_states, conv_weight, A_log, dt_bias, slots, conv_out, decay,
            beta, None, 0)  # fmt: skip


def _launch(
    conv_inputs, a, b, conv_states, conv_weight, A_log, dt_bias, slots, conv_out, decay, beta,
    records, key_dim,
):  # fmt: skip
    """The kernel over B·T rows; `records` (the five block pools) or None: no record.
    a and b may be partial sums (of one matmul, so one split stride)."""
    num_seqs, num_tokens, num_channels = conv_inputs.shape
    num_heads = a.shape[2]
    (a, gate_split_stride, gate_splits), (b, *b_splits) = kernel_operand(a), kernel_operand(b)
    if b_splits != [gate_split_stride, gate_splits]:
        raise ValueError(
            "a, b: as partial sums they need one split count and split stride (column slices "
            f"of one matmul's), got {gate_splits} splits at stride {gate_split_stride} for a "
            f"and {b_splits[1]} at stride {b_splits[0]} for b"
        )
    block_c = min(triton.next_power_of_2(num_channels), MAX_BLOCK_C)
    grid = (num_seqs * num_tokens, triton.cdiv(num_channels, block_c))
    record = records is not None
    if not record:  # never read: any pointers, zero strides
        records, record_strides = (conv_out,) * 5, (0,) * 10
    else:
        record_strides = tuple(stride for pool in records for stride in pool.stride()[:2])
    _gdn_inputs_kernel[grid](
        conv_inputs, a, b, conv_states, conv_weight, A_log, dt_bias, slots,
        conv_out, decay, beta, *records,
        num_tokens, gate_split_stride,
        *conv_inputs.stride()[:2], *a.stride()[:2], *b.stride()[:2],
        *conv_states.stride(), *conv_weight.stride(),
        *conv_out.stride()[:2], *decay.stride()[:2], *beta.stride()[:2], *record_strides,
        C=num_channels, KEY_DIM=key_dim, HV=num_heads, W=conv_weight.shape[1],
        BLOCK_C=block_c, BLOCK_H=triton.next_power_of_2(num_heads),
        THRESHOLD=SOFTPLUS_THRESHOLD, RECORD=record, GATE_SPLITS=gate_splits,
        INTERPRETED=is_interpreting(), num_warps=NUM_WARPS, **launch_options(fp_fusion=False),
    )  # fmt: skip


def prepare_gdn_inputs_reference(
    conv_inputs: torch.Tensor,
    a: torch.Tensor | SplitSums,
    b: torch.Tensor | SplitSums,
    conv_states: torch.Tensor,
    conv_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    slots: torch.Tensor,
    key_dim: int,
    conv_out: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
    block_conv_inputs: torch.Tensor,
    block_keys: torch.Tensor,
    block_values: torch.Tensor,
    block_decays: torch.Tensor,
    block_betas: torch.Tensor,
) -> None:
    """Plain-torch fp32 version of `prepare_gdn_inputs` (same arguments and effects)."""
    _check_arguments(**locals())
    prepare_gdn_prefill_inputs_reference(
        conv_inputs, a, b, conv_states, conv_weight, A_log, dt_bias, slots, conv_out, decay, beta
    )
    rows = (slots[:, None], torch.arange(conv_inputs.shape[1], device=slots.device)[None, :])
    block_conv_inputs[rows] = conv_inputs.to(block_conv_inputs.dtype)
    block_keys[rows] = conv_out[..., key_dim : 2 * key_dim].float()
    block_values[rows] = conv_out[..., 2 * key_dim :].float()
    block_decays[rows] = decay
    block_betas[rows] = beta


def prepare_gdn_prefill_inputs_reference(
    conv_inputs: torch.Tensor,
    a: torch.Tensor | SplitSums,
    b: torch.Tensor | SplitSums,
    conv_states: torch.Tensor,
    conv_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    slots: torch.Tensor,
    conv_out: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
) -> None:
    """Plain-torch fp32 version of `prepare_gdn_prefill_inputs` (same arguments and effects)."""
    _check_conv_and_gates(**locals())
    a, b = materialized(a), materialized(b)
    num_tokens, kernel = conv_inputs.shape[1], conv_weight.shape[1]
    history = conv_states[slots].to(conv_inputs.dtype).transpose(1, 2)
    window = torch.cat((history, conv_inputs), dim=1).float()
    weight = conv_weight.float()
    conv = window[:, 0:num_tokens] * weight[:, 0]
    for j in range(1, kernel):
        conv = conv + window[:, j : j + num_tokens] * weight[:, j]
    conv_out.copy_(silu(conv))
    decay.copy_(-torch.exp(A_log) * softplus(a.float() + dt_bias))
    beta.copy_(sigmoid(b.float()))


def _check_arguments(
    conv_inputs, a, b, conv_states, conv_weight, A_log, dt_bias, slots, key_dim,
    conv_out, decay, beta, block_conv_inputs, block_keys, block_values, block_decays,
    block_betas,
):  # fmt: skip
    _check_conv_and_gates(
        conv_inputs, a, b, conv_states, conv_weight, A_log, dt_bias, slots, conv_out, decay, beta
    )
    num_tokens, num_channels = conv_inputs.shape[1:]
    if not isinstance(key_dim, int) or not 0 < 2 * key_dim < num_channels:
        raise ValueError(f"key_dim must be an int in (0, C/2) with C={num_channels}, got {key_dim}")
    if block_conv_inputs.dim() != 3:
        raise ValueError(
            f"block_conv_inputs must be [S, Tmax, C], got {list(block_conv_inputs.shape)}"
        )
    max_tokens = block_conv_inputs.shape[1]
    if max_tokens < num_tokens:
        raise ValueError(f"block_conv_inputs holds {max_tokens} tokens, the block has {num_tokens}")
    heads, value_dim = A_log.shape[0], num_channels - 2 * key_dim
    f32, pool = (torch.float32,), (conv_states.shape[0], max_tokens)
    _check_tensors(
        {
            "block_conv_inputs": (block_conv_inputs, (*pool, num_channels), SUPPORTED_DTYPES),
            "block_keys": (block_keys, (*pool, key_dim), f32),
            "block_values": (block_values, (*pool, value_dim), f32),
            "block_decays": (block_decays, (*pool, heads), f32),
            "block_betas": (block_betas, (*pool, heads), f32),
        },
        conv_inputs.device,
    )


def _check_conv_and_gates(
    conv_inputs, a, b, conv_states, conv_weight, A_log, dt_bias, slots, conv_out, decay, beta
):
    if conv_inputs.dim() != 3 or 0 in conv_inputs.shape:
        raise ValueError(f"conv_inputs must be [B, T, C], non-empty, got {list(conv_inputs.shape)}")
    if conv_inputs.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"conv_inputs must be one of {SUPPORTED_DTYPES}, got {conv_inputs.dtype}")
    if conv_inputs.stride(-1) != 1:
        raise ValueError(f"conv_inputs must have a unit last stride, got {conv_inputs.stride()}")
    num_seqs, num_tokens, num_channels = conv_inputs.shape
    if A_log.dim() != 1 or A_log.numel() == 0:
        raise ValueError(f"A_log must be [Hv], non-empty, got {list(A_log.shape)}")
    if conv_weight.dim() != 2 or conv_weight.shape[0] != num_channels or conv_weight.shape[1] < 1:
        raise ValueError(
            f"conv_weight must be [C={num_channels}, W], got {list(conv_weight.shape)}"
        )
    if conv_states.dim() != 3:
        raise ValueError(f"conv_states must be [S, C, W-1], got {list(conv_states.shape)}")
    heads, kernel, num_slots = A_log.shape[0], conv_weight.shape[1], conv_states.shape[0]
    x_dtype, f32, floats = (conv_inputs.dtype,), (torch.float32,), SUPPORTED_DTYPES
    _check_tensors(
        {
            "a": (a, (num_seqs, num_tokens, heads), x_dtype),
            "b": (b, (num_seqs, num_tokens, heads), x_dtype),
            "conv_states": (conv_states, (num_slots, num_channels, kernel - 1), floats),
            "conv_weight": (conv_weight, (num_channels, kernel), floats),
            "A_log": (A_log, (heads,), f32),
            "dt_bias": (dt_bias, (heads,), f32),
            "slots": (slots, (num_seqs,), (torch.int64,)),
            "conv_out": (conv_out, (num_seqs, num_tokens, num_channels), x_dtype),
            "decay": (decay, (num_seqs, num_tokens, heads), f32),
            "beta": (beta, (num_seqs, num_tokens, heads), f32),
        },
        conv_inputs.device,
    )


def _check_tensors(expected: dict, device: torch.device) -> None:
    """Each name's tensor has its shape, one of its dtypes, the device and (but the conv
    state and weight) a unit last stride."""
    for name, (tensor, shape, dtypes) in expected.items():
        if tuple(tensor.shape) != shape or tensor.dtype not in dtypes:
            raise ValueError(
                f"{name} must be {list(shape)} {dtypes}, got {list(tensor.shape)} {tensor.dtype}"
            )
        if tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device}, conv_inputs on {device}")
        if name not in ("conv_states", "conv_weight") and tensor.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit last stride, got {tensor.stride()}")
