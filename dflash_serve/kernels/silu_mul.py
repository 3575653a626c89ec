"""silu(gate) · up in one kernel (the SwiGLU middle), instead of five elementwise launches.

Elementwise, so a row's result never depends on the row count; computed in fp32 and rounded
once to the output dtype (the plain-torch path rounds after every op, so the two agree to
bf16 rounding, not bit for bit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dflash_serve.kernels import is_interpreting, launch_options
from dflash_serve.kernels.jit_math import round_to, wait_for_inputs
from dflash_serve.layers.activations import silu

BLOCK = 1024


@triton.jit
def _silu_mul_kernel(
    gate_ptr, up_ptr, out_ptr, N, stride_g, stride_u, stride_o,
    BLOCK: tl.constexpr, IS_BF16: tl.constexpr, ROUND_ON_BITS: tl.constexpr,
):  # fmt: skip
    wait_for_inputs()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    if IS_BF16:
        out = round_to(out, tl.bfloat16, ROUND_ON_BITS)
    tl.store(out_ptr + row * stride_o + cols, out, mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [..., N]: same shape and dtype, rows may be strided (last stride 1)."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(
            f"up: expected gate's shape {list(gate.shape)} and dtype {gate.dtype}, "
            f"got {list(up.shape)} {up.dtype}"
        )
    n = gate.shape[-1]
    gate_rows, up_rows = gate.reshape(-1, n), up.reshape(-1, n)
    for name, rows in (("gate", gate_rows), ("up", up_rows)):
        if rows.stride(-1) != 1:
            raise ValueError(f"{name}: the last dim must have stride 1")
    out = torch.empty(gate_rows.shape, dtype=gate.dtype, device=gate.device)
    if out.numel():
        grid = (out.shape[0], triton.cdiv(n, BLOCK))
        _silu_mul_kernel[grid](
            gate_rows, up_rows, out, n, gate_rows.stride(0), up_rows.stride(0), out.stride(0),
            BLOCK=BLOCK, IS_BF16=gate.dtype == torch.bfloat16, ROUND_ON_BITS=is_interpreting(),
            **launch_options(),
        )  # fmt: skip
    return out.reshape(gate.shape)


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """fp32 silu(gate) · up with the plain-torch activation."""
    return silu(gate.float()) * up.float()
