"""Inputs and the tolerance the row-independent matmul tests share (`row_matmul`, `w4a16_matmul`).

Both kernels accumulate in fp32 and round once to bf16, so against an fp32 reference a result
is within 2^-8 relative plus 2^-10 of the output scale (each test file says why for its kernel).
"""

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """fp32 [N, K], small like trained weights."""
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(n, k, generator=generator, device=DEVICE) * 0.05


def random_rows(m: int, k: int, seed: int) -> torch.Tensor:
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(m, k, generator=generator, device=DEVICE).bfloat16()


def assert_close_to_fp32(y: torch.Tensor, reference: torch.Tensor) -> None:
    """bf16 y against the fp32 reference product."""
    assert y.dtype == torch.bfloat16 and reference.dtype == torch.float32
    scale = reference.abs().max().item()
    torch.testing.assert_close(y.float(), reference, rtol=2**-8, atol=2**-10 * scale)


def assert_wide_launch_gives_split_bits(matmul, x, weight, config, wide) -> torch.Tensor:
    """`matmul` (row_matmul or w4a16_matmul) through the wide launch `wide` gives the split
    launch's bits for `config`'s K splits, and with keep_splits the same bf16 result (no
    partials); returns that result."""
    expected = matmul(x, weight, config=config, wide=None)
    y = matmul(x, weight, config=config, wide=wide)
    assert torch.equal(y.view(torch.int16), expected.view(torch.int16))
    kept = matmul(x, weight, config=config, keep_splits=True, wide=wide)
    assert isinstance(kept, torch.Tensor) and torch.equal(kept, expected)
    return y
