"""silu_mul (Triton) against its fp32 reference, and row independence bit for bit."""

from __future__ import annotations

import pytest
import torch

from dflash_serve.kernels.silu_mul import silu_mul, silu_mul_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_reference_on_strided_halves(dtype):
    """gate and up as the two halves of one fused projection output, N not a block multiple."""
    torch.manual_seed(0)
    fused = (torch.randn(37, 2 * 1500, device=DEVICE) * 4).to(dtype)
    gate, up = fused.split(1500, dim=-1)
    out = silu_mul(gate, up)
    expected = silu_mul_reference(gate, up)
    tolerance = 2**-8 if dtype == torch.bfloat16 else 1e-6  # one rounding of the output
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=1e-6)


def test_rows_are_independent():
    torch.manual_seed(1)
    gate = torch.randn(16, 300, device=DEVICE, dtype=torch.bfloat16)
    up = torch.randn(16, 300, device=DEVICE, dtype=torch.bfloat16)
    together = silu_mul(gate, up)
    for row in (0, 7, 15):
        assert torch.equal(
            silu_mul(gate[row : row + 1], up[row : row + 1]), together[row : row + 1]
        )


def test_mismatched_inputs_are_rejected():
    gate = torch.randn(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="up"):
        silu_mul(gate, torch.randn(2, 9, device=DEVICE))
