"""What the row kernel reads for a 4-bit layer: the packed bits (default) or its bf16 copy.

Both must give the reference product: the bf16 copy (which reads no repacked tensors at all)
that of the bf16-rounded weight, the packed bits (`w4a16_matmul`) that of the exact fp32
weight; the choice reaches the service from `--int4-reads`.
"""

from __future__ import annotations

import pytest
import torch

from dflash_serve.checkpoint.int4_formats import AWQ_GEMM, PackedInt4Weight, pack_awq_gemm
from dflash_serve.errors import ConfigError
from dflash_serve.kernels.row_matmul import row_matmul_reference
from dflash_serve.kernels.w4a16_matmul import PlanarInt4
from dflash_serve.layers.linear import Int4Linear, RowKernelGroup
from launcher.main import build_parser
from target_service.config import TargetServiceConfig

pytest.importorskip("triton")

N, K, GROUP = 40, 320, 32
# Where the kernels run: compiled on a GPU, else in Triton's interpreter on the CPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def int4_layer(n: int = N, seed: int = 3) -> Int4Linear:
    weight = torch.randn(n, K, generator=torch.Generator().manual_seed(seed)) * 0.05
    packed = PackedInt4Weight(AWQ_GEMM, n, K, GROUP, pack_awq_gemm(weight, GROUP))
    return Int4Linear(packed, torch.bfloat16).to(DEVICE)


@pytest.mark.parametrize("reads", ["bf16", "int4"])
def test_both_reads_give_the_dequantized_product(reads):
    layer = int4_layer()
    layer.use_row_kernel(16, reads)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(4)).bfloat16().to(DEVICE)
    if reads == "bf16":
        assert layer.kernel_weight() is layer.weight and layer.repacked is None
        weight = layer.packed.dequantize(torch.bfloat16).to(DEVICE)
    else:
        assert isinstance(layer.kernel_weight(), PlanarInt4)
        weight = layer.packed.dequantize(torch.float32).to(DEVICE)
    with torch.inference_mode():
        y = layer(x)
    reference = row_matmul_reference(x, weight)
    scale = reference.abs().max().item()
    torch.testing.assert_close(y.float(), reference, rtol=2**-8, atol=2**-10 * scale)


def test_the_packed_bits_are_the_default_and_others_are_refused():
    layer = int4_layer()
    layer.use_row_kernel(16)
    assert isinstance(layer.kernel_weight(), PlanarInt4)
    layer.use_row_kernel(16, "bf16")
    assert layer.kernel_weight() is layer.weight
    with pytest.raises(ValueError, match="reads must be one of"):
        layer.use_row_kernel(16, "fp8")


def test_the_flag_reaches_the_target_config():
    parser = build_parser()
    assert parser.parse_args(["target", "--model", "m"]).int4_reads == "int4"
    assert parser.parse_args(["target", "--model", "m", "--int4-reads", "bf16"]).int4_reads == (
        "bf16"
    )
    with pytest.raises(SystemExit):
        parser.parse_args(["target", "--model", "m", "--int4-reads", "fp8"])
    with pytest.raises(ConfigError, match="int4_reads"):
        TargetServiceConfig(model="m", int4_reads="fp8").validate()


def test_a_group_keeps_one_packed_copy_and_its_members_refuse_the_kernel_alone():
    """Stacked 4-bit members free their own repacked copies (a second copy of every weight
    otherwise); the group's outputs are each member's product, and a member called alone on
    the kernel path says where its weight went instead of reading something else."""
    first, second = int4_layer(), int4_layer(n=24, seed=5)
    for layer in (first, second):
        layer.use_row_kernel(16, "int4")
    alone = [layer.kernel_weight() for layer in (first, second)]
    group = RowKernelGroup([first, second])
    assert first.repacked is None and second.repacked is None
    ((_indices, stacked, _sizes),) = group.calls
    assert torch.equal(stacked.words, torch.cat([w.words for w in alone], dim=1))
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(6)).bfloat16().to(DEVICE)
    with torch.inference_mode():
        outputs = group(x)
        for layer, out in zip((first, second), outputs, strict=True):
            reference = row_matmul_reference(x, layer.packed.dequantize(torch.float32).to(DEVICE))
            scale = reference.abs().max().item()
            torch.testing.assert_close(out.float(), reference, rtol=2**-8, atol=2**-10 * scale)
        with pytest.raises(RuntimeError, match="RowKernelGroup"):
            first(x)
        assert first(torch.zeros(17, K, dtype=torch.bfloat16, device=DEVICE)).shape == (17, N)
    first.use_row_kernel(16, "int4")  # set up again: it reads its own copy
    assert isinstance(first.kernel_weight(), PlanarInt4)
