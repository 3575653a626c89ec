"""Per-head RMSNorm, then rotary position embedding: the q/k path of attention, one kernel.

On the kernel path a query or key took the norm kernel and then ~7 elementwise launches for
the rotation (casts of cos and sin, a negation, two concatenations, two products, a sum): in
a CUDA-graphed step each is a few microseconds of launch gap for a few kilobytes of work. Here
one program normalises one head of one token and rotates its first ROT dims (NeoX halves).

Bit for bit the `rms_norm` kernel followed by `apply_rotary` in torch: the norm is the same
device code (so the same reduction order, fixed by D alone: rows stay independent); its
result is rounded to x's dtype; cos and sin are rounded to it; each product and the sum are
rounded to it as torch's elementwise ops round them. Products use IEEE multiplication
(`mul_rn`), never contracted into a fused multiply-add, as torch's separate kernels are not.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from dflash_serve.kernels import is_interpreting, launch_options
from dflash_serve.kernels.jit_math import round_to, wait_for_inputs
from dflash_serve.kernels.rms_norm import _check_input, _normed_row, _num_warps, _rows
from dflash_serve.layers import norm_math
from dflash_serve.layers.rotary import apply_rotary


@triton.jit
def _mul_rn(a, b, INTERPRETED: tl.constexpr):
    if INTERPRETED:
        return a * b
    return libdevice.mul_rn(a, b)


@triton.jit
def _norm_rotary_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr,
    x_stride_token, x_stride_head, cs_stride_token, num_heads, eps,
    D: tl.constexpr, BLOCK: tl.constexpr, HALF: tl.constexpr, ZERO_CENTRED: tl.constexpr,
    INTERPRETED: tl.constexpr,
):  # fmt: skip
    wait_for_inputs()
    row = tl.program_id(0).to(tl.int64)
    token, _head, cols, mask, y = _normed_row(
        x_ptr, w_ptr, row, x_stride_token, x_stride_head, num_heads, eps,
        D, BLOCK, ZERO_CENTRED, INTERPRETED,
    )  # fmt: skip
    store_rotated(
        y, out_ptr + row * D, cols, mask, cos_ptr + token * cs_stride_token,
        sin_ptr + token * cs_stride_token, HALF, INTERPRETED,
    )  # fmt: skip


@triton.jit
def store_rotated(
    y, out_row, cols, mask, cos_row, sin_row, HALF: tl.constexpr, INTERPRETED: tl.constexpr
):
    """Store one normalised fp32 head `y` at `out_row`, rounded to its dtype, then rotate its
    first 2·HALF dims in place with this token's cos and sin (`out_row` may be a row of a
    cache as well as of a plain output)."""
    dtype = out_row.dtype.element_ty
    normed = round_to(y, dtype, INTERPRETED)
    tl.store(out_row + cols, normed, mask=mask)
    # The rotation pairs dim c with c ± HALF: read the partner back from this program's own
    # row once every thread's store is visible.
    tl.debug_barrier()
    is_rotated = cols < 2 * HALF
    partner_cols = tl.where(cols < HALF, cols + HALF, cols - HALF)
    partner = tl.load(out_row + partner_cols, mask=is_rotated, other=0.0).to(tl.float32)
    rotate_half = tl.where(cols < HALF, -partner, partner)
    cos = tl.load(cos_row + cols, mask=is_rotated, other=0.0)
    sin = tl.load(sin_row + cols, mask=is_rotated, other=0.0)
    cos = round_to(cos, dtype, INTERPRETED).to(tl.float32)
    sin = round_to(sin, dtype, INTERPRETED).to(tl.float32)
    with_cos = round_to(_mul_rn(normed.to(tl.float32), cos, INTERPRETED), dtype, INTERPRETED)
    with_sin = round_to(_mul_rn(rotate_half, sin, INTERPRETED), dtype, INTERPRETED)
    rotated = round_to(with_cos.to(tl.float32) + with_sin.to(tl.float32), dtype, INTERPRETED)
    tl.debug_barrier()  # every partner is read before any rotated value overwrites it
    tl.store(out_row + cols, rotated, mask=is_rotated)


def norm_rotary(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    zero_centred: bool,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """`apply_rotary(RMSNorm(x), cos, sin)` per head.

    x: [..., heads, D] bf16/fp16/fp32 with a unit last stride (a strided view, such as the
    query half of Qwen3.5's query-and-gate projection, is read in place); weight: [D];
    cos, sin: fp32 [..., ROT] per token, broadcastable to x's leading dims without the
    heads; ROT even and <= D. Returns a new contiguous tensor like x; no host synchronisation.
    """
    _check_input(x, weight)
    if x.dim() < 2:
        raise ValueError(f"x must be [..., heads, head_dim], got shape {tuple(x.shape)}")
    dim, num_heads, rotary_dim = x.shape[-1], x.shape[-2], cos.shape[-1]
    per_token = (*x.shape[:-2], rotary_dim)
    try:
        cos, sin = cos.expand(per_token), sin.expand(per_token)
    except RuntimeError:
        raise ValueError(
            f"cos and sin must broadcast to {list(per_token)} (per token of x, shape "
            f"{tuple(x.shape)}); got {tuple(cos.shape)} and {tuple(sin.shape)}"
        ) from None
    if rotary_dim % 2 or not 0 < rotary_dim <= dim:
        raise ValueError(f"rotary_dim must be even and in 2..{dim}, got {rotary_dim}")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError(f"cos and sin must be float32, got {cos.dtype} and {sin.dtype}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    tokens = _rows(x)  # [tokens, heads, D]: a view for the layouts used, else a copy
    cos_rows = cos.reshape(-1, rotary_dim).contiguous()
    sin_rows = sin.reshape(-1, rotary_dim).contiguous()
    block = triton.next_power_of_2(dim)
    _norm_rotary_kernel[(tokens.shape[0] * num_heads,)](
        tokens, weight, cos_rows, sin_rows, out,
        tokens.stride(0), tokens.stride(1), rotary_dim, num_heads, eps,
        D=dim, BLOCK=block, HALF=rotary_dim // 2, ZERO_CENTRED=zero_centred,
        INTERPRETED=is_interpreting(), num_warps=_num_warps(block),
        **launch_options(),
    )  # fmt: skip
    return out


def norm_rotary_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    zero_centred: bool,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """The plain-torch path: `RMSNorm.forward`'s arithmetic, then `apply_rotary`."""
    return apply_rotary(norm_math.rms_norm(x, weight, eps, zero_centred), cos, sin)
