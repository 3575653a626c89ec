"""Row-independent RMSNorm and gated RMSNorm for the verify/decode path.

torch's reduction kernels on the GPU choose how to split a row's Σx² from the number of rows,
so a token's low bits would depend on how many tokens share the launch. Here one program
normalises one row and the reduction block is fixed by D alone (next power of two ≥ D, masked
lanes add zero), so a row's result is the same alone, in a 16-token block or in a batch.

Everything that is not the reduction follows `dflash_serve.layers.norm_math` step for step: the
same fp32 operations in the same order, the same roundings to bf16, IEEE division, and on the
GPU libdevice's `expf`/`rsqrtf`, the functions torch's CUDA kernels call (Triton's own `tl.exp`
and `/` are approximate there). The interpreter has no libdevice and uses numpy's instead.
The `*_reference` functions run the torch modules themselves.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from dflash_serve.kernels import is_interpreting, launch_options
from dflash_serve.kernels.jit_math import exact_exp, load_summed, round_to, wait_for_inputs
from dflash_serve.layers import norm_math
from dflash_serve.layers.split_sums import SplitSums, kernel_operand, materialized

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _inv_rms(x, D: tl.constexpr, eps, INTERPRETED: tl.constexpr):
    """rsqrt(mean(x²) + eps) of one fp32 row padded with zeros.

    The mean divides by D (IEEE), as torch does on CPU; torch on CUDA multiplies by 1/D. Both
    belong to the reduction, the one step allowed to differ.
    """
    mean_sq = tl.div_rn(tl.sum(x * x, axis=0), D * 1.0)
    if INTERPRETED:
        return tl.rsqrt(mean_sq + eps)
    return libdevice.rsqrt(mean_sq + eps)


# The row count per leading index (tokens of a context, heads of a q/k norm) varies from call
# to call; specialised, 1 and multiples of 16 each compiled their own variant, in the middle
# of a request (on the H200 one was compiled at the moment of a 145 ms draft).
ROW_COUNT_NOT_SPECIALISED = ["num_rows_b"]


@triton.jit(do_not_specialize=ROW_COUNT_NOT_SPECIALISED)
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr,
    x_stride_a, x_stride_b, out_stride_a, out_stride_b, num_rows_b, eps,
    D: tl.constexpr, BLOCK: tl.constexpr, ZERO_CENTRED: tl.constexpr,
    INTERPRETED: tl.constexpr,
):  # fmt: skip
    wait_for_inputs()
    row = tl.program_id(0).to(tl.int64)
    row_a, row_b, cols, mask, y = _normed_row(
        x_ptr, w_ptr, row, x_stride_a, x_stride_b, num_rows_b, eps,
        D, BLOCK, ZERO_CENTRED, INTERPRETED,
    )  # fmt: skip
    out_ptrs = out_ptr + row_a * out_stride_a + row_b * out_stride_b + cols
    tl.store(out_ptrs, round_to(y, out_ptr.dtype.element_ty, INTERPRETED), mask=mask)


@triton.jit
def _normed_row(
    x_ptr, w_ptr, row, x_stride_a, x_stride_b, num_rows_b, eps,
    D: tl.constexpr, BLOCK: tl.constexpr, ZERO_CENTRED: tl.constexpr,
    INTERPRETED: tl.constexpr,
):  # fmt: skip
    """Row `row` of x read as [A, B, D] (row = a·B + b), normalised in fp32 (not rounded):
    the norm of `rms_norm` and of `norm_rotary`. Returns (a, b, cols, mask, normalised)."""
    row_a = row // num_rows_b
    row_b = row % num_rows_b
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row_a * x_stride_a + row_b * x_stride_b + cols, mask=mask, other=0.0)
    y = _scaled_norm(x.to(tl.float32), w_ptr, cols, mask, D, eps, ZERO_CENTRED, INTERPRETED)
    return row_a, row_b, cols, mask, y


@triton.jit
def _scaled_norm(x, w_ptr, cols, mask, D: tl.constexpr, eps, ZERO_CENTRED: tl.constexpr,
                 INTERPRETED: tl.constexpr):  # fmt: skip
    """x̂ · (1 + w) or x̂ · w of one fp32 row, in fp32."""
    scale = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTRED:
        scale = 1.0 + scale
    return (x * _inv_rms(x, D, eps, INTERPRETED)) * scale


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, delta_ptr, w_ptr, sum_ptr, out_ptr, eps, split_stride,
    D: tl.constexpr, BLOCK: tl.constexpr, ZERO_CENTRED: tl.constexpr, DELTA_SPLITS: tl.constexpr,
    INTERPRETED: tl.constexpr,
):  # fmt: skip
    """The residual add, rounded to the sum's dtype as torch's add rounds it, then the norm of
    that rounded sum: one pass over the row instead of an add kernel and a norm kernel.
    DELTA_SPLITS > 0: delta is fp32 split-K partial sums (split s at s·split_stride), summed
    and rounded to bf16 here exactly as `row_matmul`'s sum kernel would have."""
    wait_for_inputs()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    delta = load_summed(delta_ptr, row * D + cols, mask, split_stride, DELTA_SPLITS, INTERPRETED)
    total = round_to(x + delta, sum_ptr.dtype.element_ty, INTERPRETED)
    tl.store(sum_ptr + row * D + cols, total, mask=mask)
    y = _scaled_norm(total.to(tl.float32), w_ptr, cols, mask, D, eps, ZERO_CENTRED, INTERPRETED)
    tl.store(
        out_ptr + row * D + cols, round_to(y, out_ptr.dtype.element_ty, INTERPRETED), mask=mask
    )


@triton.jit(do_not_specialize=ROW_COUNT_NOT_SPECIALISED)
def _gated_rms_norm_kernel(
    x_ptr, gate_ptr, w_ptr, out_ptr,
    x_stride_a, x_stride_b, gate_stride_a, gate_stride_b, out_stride_a, out_stride_b,
    num_rows_b, eps,
    D: tl.constexpr, BLOCK: tl.constexpr, PRODUCT_DTYPE: tl.constexpr,
    INTERPRETED: tl.constexpr,
):  # fmt: skip
    wait_for_inputs()
    row = tl.program_id(0).to(tl.int64)
    row_a = row // num_rows_b
    row_b = row % num_rows_b
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row_a * x_stride_a + row_b * x_stride_b + cols, mask=mask, other=0.0)
    x = x.to(tl.float32)
    normed = x * _inv_rms(x, D, eps, INTERPRETED)
    normed = round_to(normed, x_ptr.dtype.element_ty, INTERPRETED).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    weighted = round_to(w * normed, PRODUCT_DTYPE, INTERPRETED).to(tl.float32)
    gate_ptrs = gate_ptr + row_a * gate_stride_a + row_b * gate_stride_b + cols
    z = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    silu_z = z * tl.div_rn(1.0, 1.0 + exact_exp(-z, INTERPRETED))
    y = weighted * silu_z
    out_ptrs = out_ptr + row_a * out_stride_a + row_b * out_stride_b + cols
    tl.store(out_ptrs, round_to(y, out_ptr.dtype.element_ty, INTERPRETED), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    zero_centred: bool,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`RMSNorm` over the last dim: `x̂ · (1 + w)` if `zero_centred` else `x̂ · w`.

    x: [..., D] bf16/fp16/fp32 (leading dims are rows; views with a unit last stride are read
    in place); weight: [D], any float dtype; out: optional [..., D] tensor of x's dtype,
    viewable as rows (it may be `x`). Returns `out`, or a new contiguous tensor like x.
    Only the order of Σx² differs from `RMSNorm.forward`; no host synchronisation.
    """
    _check_input(x, weight)
    out = _prepare_out(x, out)
    if x.numel() == 0:
        return out
    x_rows, out_rows = _rows(x), _row_view(out)
    dim = x.shape[-1]
    block = triton.next_power_of_2(dim)
    _rms_norm_kernel[(x_rows.shape[0] * x_rows.shape[1],)](
        x_rows, weight, out_rows,
        x_rows.stride(0), x_rows.stride(1), out_rows.stride(0), out_rows.stride(1),
        x_rows.shape[1], eps,
        D=dim, BLOCK=block, ZERO_CENTRED=zero_centred, INTERPRETED=is_interpreting(),
        num_warps=_num_warps(block),
        **launch_options(),
    )  # fmt: skip
    return out


def add_rms_norm(
    x: torch.Tensor,
    delta: torch.Tensor | SplitSums,
    weight: torch.Tensor,
    eps: float,
    zero_centred: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, `rms_norm`(x + delta)) in one kernel: the residual stream's add and the next
    norm. x, delta: [..., D] of one dtype (bf16/fp16/fp32) and shape; returns new contiguous
    tensors; the sum is bit for bit torch's `x + delta`, the norm `rms_norm` of that sum.
    delta may be a bf16 matmul result left as split-K partial sums (`SplitSums`, x bf16):
    they are summed here, bit for bit `delta.total()`, saving the sum's own launch."""
    _check_input(x, weight)
    delta_shape, delta_dtype = tuple(delta.shape), delta.dtype  # (SplitSums: the result's)
    if isinstance(delta, SplitSums):
        partials = delta.partials
        if partials.dtype != torch.float32 or not partials.is_contiguous():
            raise ValueError("delta: split-K partial sums must be contiguous fp32")
        if partials[0].numel() != x.numel() or partials.device != x.device:
            raise ValueError(f"delta: partial sums {tuple(partials.shape)} for x {tuple(x.shape)}")
    else:
        delta = delta.contiguous()
    delta, split_stride, splits = kernel_operand(delta)
    if delta_shape != tuple(x.shape) or delta_dtype != x.dtype or delta.device != x.device:
        expected = f"{x.dtype} {tuple(x.shape)} on {x.device}"
        raise ValueError(f"delta must be {expected}, got {delta_dtype} {delta_shape}")
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out = torch.empty_like(total)
    if x.numel() == 0:
        return total, out
    dim = x.shape[-1]
    block = triton.next_power_of_2(dim)
    _add_rms_norm_kernel[(x.numel() // dim,)](
        x.contiguous(), delta, weight, total, out, eps, split_stride,
        D=dim, BLOCK=block, ZERO_CENTRED=zero_centred, DELTA_SPLITS=splits,
        INTERPRETED=is_interpreting(), num_warps=_num_warps(block), **launch_options(),
    )  # fmt: skip
    return total, out


def gated_rms_norm(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`GatedRMSNorm`: `(w · x̂.to(x.dtype)) ⊙ silu(gate)` per row of the last dim.

    x: [..., D] bf16/fp16/fp32; gate: x's shape, any float dtype; weight: [D], any float
    dtype (`w · x̂` is rounded to the promoted dtype of weight and x, as torch does); out: as
    in `rms_norm`. Only the order of Σx² differs from `GatedRMSNorm.forward`.
    """
    _check_input(x, weight)
    if gate.shape != x.shape:
        raise ValueError(f"gate must have x's shape {tuple(x.shape)}, got {tuple(gate.shape)}")
    if not gate.is_floating_point() or gate.device != x.device:
        actual = f"{gate.dtype} on {gate.device}"
        raise ValueError(f"gate must be a float tensor on {x.device}, got {actual}")
    out = _prepare_out(x, out)
    if x.numel() == 0:
        return out
    x_rows, gate_rows, out_rows = _rows(x), _rows(gate), _row_view(out)
    dim = x.shape[-1]
    block = triton.next_power_of_2(dim)
    product_dtype = _TL_DTYPES.get(torch.promote_types(weight.dtype, x.dtype), tl.float32)
    _gated_rms_norm_kernel[(x_rows.shape[0] * x_rows.shape[1],)](
        x_rows, gate_rows, weight, out_rows,
        x_rows.stride(0), x_rows.stride(1), gate_rows.stride(0), gate_rows.stride(1),
        out_rows.stride(0), out_rows.stride(1), x_rows.shape[1], eps,
        D=dim, BLOCK=block, PRODUCT_DTYPE=product_dtype, INTERPRETED=is_interpreting(),
        num_warps=_num_warps(block),
        **launch_options(),
    )  # fmt: skip
    return out


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool
) -> torch.Tensor:
    """`RMSNorm.forward`'s arithmetic with the given weight (torch's own reductions)."""
    return norm_math.rms_norm(x, weight, eps, zero_centred)


def add_rms_norm_reference(
    x: torch.Tensor,
    delta: torch.Tensor | SplitSums,
    weight: torch.Tensor,
    eps: float,
    zero_centred: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's add, then `RMSNorm.forward`'s arithmetic on the sum; split-K partial sums
    added in split order in fp32 and rounded to bf16 first (`SplitSums.total`, plain torch)."""
    total = x + materialized(delta)
    return total, norm_math.rms_norm(total, weight, eps, zero_centred)


def gated_rms_norm_reference(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """`GatedRMSNorm.forward`'s arithmetic with the given weight (torch's own reductions)."""
    return norm_math.gated_rms_norm(x, gate, weight, eps)


def _check_input(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"x must be one of {SUPPORTED_DTYPES}, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dim, got shape {tuple(x.shape)}")
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must have shape ({x.shape[-1]},), got {tuple(weight.shape)}")
    if not weight.is_floating_point() or weight.device != x.device:
        actual = f"{weight.dtype} on {weight.device}"
        raise ValueError(f"weight must be a float tensor on {x.device}, got {actual}")


def _prepare_out(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
        expected = f"{x.dtype} {tuple(x.shape)} on {x.device}"
        raise ValueError(f"out must be {expected}, got {out.dtype} {tuple(out.shape)}")
    if x.numel() > 0 and _row_view(out) is None:
        raise ValueError(f"out must be viewable as rows, got strides {out.stride()}")
    return out


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[A, B, D] with unit last stride: rows are (a, b); copies only if no such view exists."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() == 1:
        return t.view(1, 1, -1)
    return t.reshape(-1, t.shape[-2], t.shape[-1])


def _row_view(t: torch.Tensor) -> torch.Tensor | None:
    """Like `_rows` but never copies (for `out`); None if `t` has no such view."""
    if t.stride(-1) != 1:
        return None
    if t.dim() == 1:
        return t.view(1, 1, -1)
    try:
        return t.view(-1, t.shape[-2], t.shape[-1])
    except RuntimeError:
        return None


def _num_warps(block: int) -> int:
    """From the row block only, never from the row count: the reduction tree depends on it."""
    return min(8, max(1, block // 256))
