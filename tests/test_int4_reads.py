"""What the row kernel reads for a 4-bit layer: the packed bits (default) or its bf16 copy.

Both must give the reference product: the bf16 copy (which reads no repacked tensors at all)
that of the bf16-rounded weight, the packed bits (`w4a16_matmul`) that of the exact fp32
weight; the choice reaches the service from `--int4-reads`. Prefill forwards read the bf16
copy whatever verify reads (`reading_bf16_copies`, `--prefill-int4-reads`).
"""

from __future__ import annotations

import pytest
import torch

from dflash_serve.checkpoint.int4_formats import AWQ_GEMM, PackedInt4Weight, pack_awq_gemm
from dflash_serve.checkpoint.synthetic import QWEN35_4B_TEXT, write_target
from dflash_serve.errors import ConfigError
from dflash_serve.kernels.row_matmul import row_matmul, row_matmul_reference
from dflash_serve.kernels.w4a16_matmul import PlanarInt4, w4a16_matmul
from dflash_serve.layers import linear
from dflash_serve.layers.int4_reads import check_int4_reads
from dflash_serve.layers.linear import Int4Linear, RowKernelGroup, reading_bf16_copies
from launcher.main import build_parser
from target_service.config import TargetServiceConfig
from target_service.engine import TargetEngine
from target_service.model.loader import load_target_model
from target_service.model.state import StateShape
from tests.prefill_checks import assert_each_as_alone
from tests.tiny_checkpoints import KERNEL_FRIENDLY

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


def test_under_reading_bf16_copies_a_packed_layer_reads_its_copy_bit_for_bit():
    layer = int4_layer()
    layer.use_row_kernel(16, "int4")
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(7)).bfloat16().to(DEVICE)
    with torch.inference_mode():
        packed = layer(x)
        with reading_bf16_copies():
            copy = layer(x)
        with reading_bf16_copies(False):
            assert torch.equal(layer(x), packed)
        assert torch.equal(packed, w4a16_matmul(x, layer.repacked))
        assert torch.equal(copy, row_matmul(x, layer.weight))
    assert not torch.equal(copy, packed)  # the two reads round differently: the check can fail


def test_a_group_stacks_its_packed_members_copies_as_views_for_prefill():
    """Under `reading_bf16_copies` the group runs the same matmuls over its members' bf16
    copies, stacked once (each member's copy a view of the stack, no second copy); a member
    called alone on the kernel path still refuses, as it does outside."""
    first, second = int4_layer(), int4_layer(n=24, seed=5)
    copies = [layer.weight.clone() for layer in (first, second)]
    for layer in (first, second):
        layer.use_row_kernel(16, "int4")
    group = RowKernelGroup([first, second])
    ((_indices, stacked, _sizes),) = group.copy_calls
    assert torch.equal(stacked, torch.cat(copies))
    for layer, rows in ((first, slice(0, N)), (second, slice(N, N + 24))):
        assert layer.weight.data_ptr() == stacked[rows].data_ptr()
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(8)).bfloat16().to(DEVICE)
    with torch.inference_mode():
        packed = group(x)
        with reading_bf16_copies():
            read = group(x)
            assert torch.equal(group.stacked(x), row_matmul(x, stacked))
            with pytest.raises(RuntimeError, match="RowKernelGroup"):
                first(x)  # alone it would split K by its own shape: other bits
        whole = row_matmul(x, stacked)
    assert torch.equal(read[0], whole[:, :N]) and torch.equal(read[1], whole[:, N:])
    assert not torch.equal(read[0], packed[0])


def tiny_int4_mlp_model(tmp_path, prefill_int4_reads):
    """A 4-layer int4-MLP target (AWQ groups of 128) on the row kernels, up to 64 rows."""
    sizes = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4}
    config = QWEN35_4B_TEXT | KERNEL_FRIENDLY | sizes
    config["layer_types"] = ["linear_attention"] * 3 + ["full_attention"]
    model_dir = write_target(tmp_path / "int4_mlp", config, "int4_mlp", device=DEVICE)
    model = load_target_model(model_dir, torch.bfloat16, DEVICE)
    model.use_gpu_kernels(64, "int4", prefill_int4_reads)
    return model


@pytest.mark.parametrize("prefill_int4_reads", ["bf16", "int4"])
def test_prefill_forwards_read_what_the_flag_says_and_verify_the_packed_bits(
    tmp_path, monkeypatch, prefill_int4_reads
):
    """Which weights the row kernels get: a padded prefill (the prefill graphs' forward) reads
    no packed bits by default, and the MLPs' packed bits with `prefill_int4_reads="int4"`;
    a verify reads the MLPs' packed bits either way."""
    model = tiny_int4_mlp_model(tmp_path, prefill_int4_reads)
    reads = []
    kernel_matmul = linear.row_kernel_matmul

    def recorded(rows, weight, keep_splits=False):
        reads.append(isinstance(weight, PlanarInt4))
        return kernel_matmul(rows, weight, keep_splits)

    monkeypatch.setattr(linear, "row_kernel_matmul", recorded)
    engine = TargetEngine(model, StateShape(max_slots=1, max_len=48), (), prefill_run_tokens=(16,))
    slot = engine.open_sequence()
    engine.prefill(slot, list(range(3, 15)))
    prefill_reads, reads[:] = list(reads), []
    engine.verify([slot], [[5, 6, 7]])
    mlp_reads = 2 * model.config.num_hidden_layers  # gate·up (one group) and down, per layer
    assert sum(prefill_reads) == (mlp_reads if prefill_int4_reads == "int4" else 0)
    assert sum(reads) == mlp_reads


def test_the_prefill_flag_reaches_the_target_config():
    parser = build_parser()
    assert parser.parse_args(["target", "--model", "m"]).prefill_int4_reads == "bf16"
    args = parser.parse_args(["target", "--model", "m", "--prefill-int4-reads", "int4"])
    assert args.prefill_int4_reads == "int4"
    with pytest.raises(SystemExit):
        parser.parse_args(["target", "--model", "m", "--prefill-int4-reads", "fp8"])
    with pytest.raises(ConfigError, match="prefill_int4_reads"):
        TargetServiceConfig(model="m", prefill_int4_reads="fp8").validate()


def test_a_group_built_under_reading_bf16_copies_still_stacks_the_packed_bits():
    """The group sorts its members by what verify reads, whatever context builds it."""
    first, second = int4_layer(), int4_layer(n=24, seed=5)
    for layer in (first, second):
        layer.use_row_kernel(16, "int4")
    with reading_bf16_copies():
        group = RowKernelGroup([first, second])
    ((_indices, stacked, _sizes),) = group.calls
    assert isinstance(stacked, PlanarInt4) and first.repacked is None


@pytest.mark.parametrize("prefill_int4_reads", ["bf16", "int4"])
def test_int4_prompts_prefilled_together_equal_each_alone(tmp_path, prefill_int4_reads):
    """A shared padded prefill of a 4-bit target (its group's copies or packed bits) gives
    each prompt the bits of its prefill alone, and the same decoding after."""
    model = tiny_int4_mlp_model(tmp_path, prefill_int4_reads)
    prompts = [
        [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 1, 2],
        [7 * i % 97 + 1 for i in range(9)],
    ]

    def new_engine(prefill_batch_rows):
        shape = StateShape(max_slots=2, max_len=48)
        return TargetEngine(
            model, shape, (1,), prefill_run_tokens=(16,), prefill_batch_rows=prefill_batch_rows
        )

    together = new_engine(None)
    assert together.prefill_group_size(16) == 2
    slots = [together.open_sequence() for _ in prompts]
    results = together.prefill_together(slots, prompts)
    assert_each_as_alone(together, slots, prompts, results, lambda: new_engine(0), 2)


def test_prefill_reading_packed_bits_needs_verify_reading_them():
    """With --int4-reads bf16 no packed copy exists: prefill could not read one."""
    with pytest.raises(ConfigError, match="needs int4_reads 'int4'"):
        TargetServiceConfig(model="m", int4_reads="bf16", prefill_int4_reads="int4").validate()
    TargetServiceConfig(model="m", int4_reads="bf16", prefill_int4_reads="bf16").validate()
    with pytest.raises(ValueError, match="needs int4_reads 'int4'"):
        check_int4_reads("bf16", "int4")


def test_the_reads_reach_the_model_from_the_command_line(causal_lm_dir, monkeypatch):
    """launcher → TargetServiceConfig → TargetRuntime → use_gpu_kernels, both reads."""
    from dflash_serve.service_settings import ServiceSettings
    from launcher.main import run_target
    from target_service import server
    from target_service.model.decoder import Qwen35TextModel
    from target_service.runtime import TargetRuntime

    configs, asked = [], []

    async def serve(config):
        configs.append(config)

    monkeypatch.setattr(server, "serve", serve)
    argv = ["target", "--model", str(causal_lm_dir), "--prefill-int4-reads", "int4"]
    run_target(build_parser().parse_args(argv))
    (config,) = configs
    assert (config.int4_reads, config.prefill_int4_reads) == ("int4", "int4")

    def use_gpu_kernels(self, max_kernel_rows, int4_reads, prefill_int4_reads):
        asked.append((int4_reads, prefill_int4_reads))
        raise ConfigError("stopped after use_gpu_kernels")

    monkeypatch.setattr(ServiceSettings, "uses_gpu_fast_path", lambda self: True)
    monkeypatch.setattr(Qwen35TextModel, "use_gpu_kernels", use_gpu_kernels)
    with pytest.raises(ConfigError, match="stopped after"):
        TargetRuntime(config)
    assert asked == [("int4", "int4")]
