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
from dflash_serve.layers.linear import Int4Linear
from launcher.main import build_parser
from target_service.config import TargetServiceConfig

pytest.importorskip("triton")

N, K, GROUP = 40, 320, 32
# Where the kernels run: compiled on a GPU, else in Triton's interpreter on the CPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def int4_layer() -> Int4Linear:
    weight = torch.randn(N, K, generator=torch.Generator().manual_seed(3)) * 0.05
    packed = PackedInt4Weight(AWQ_GEMM, N, K, GROUP, pack_awq_gemm(weight, GROUP))
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
