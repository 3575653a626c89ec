"""4-bit AWQ / compressed-tensors weights against a per-element oracle written from the formulas.

The oracle below reads nibbles one at a time with Python ints, as AutoAWQ's GEMM packer and
compressed-tensors' pack_to_int32 lay them out, and shares no code with the module.
(q - z) * s is exact in fp32 (a 4-bit integer times an fp16/bf16 scale), so dequantization
is compared bit for bit.
"""

import pytest
import torch
from safetensors.torch import save_file

from dflash_serve.checkpoint.int4_formats import (
    PackedInt4Weight,
    awq_quantization_config,
    compressed_tensors_quantization_config,
    detect_linear_format,
    pack_awq_gemm,
    pack_compressed_tensors,
    read_int4_weight,
)
from dflash_serve.checkpoint.safetensors_reader import TensorReader
from dflash_serve.errors import CheckpointError

PREFIX = "model.layers.0.mlp.up_proj."
# (out_features N, in_features K, group size): N not a power of two, K not a power of two.
SHAPES = [(24, 64, 32), (40, 96, 32), (40, 96, 16), (24, 128, 64)]
AWQ_COLUMN_OF_NIBBLE = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ from_linear's order_map
# The quantizers round to nearest, so |w - dequantized| <= step / 2 exactly in real
# arithmetic; this slack only absorbs the fp32 rounding of w / s, nothing else.
FP32_SLACK = 1 + 2**-20


def random_weight(n, k, seed, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=generator) * 0.05).to(dtype)


def nibble(word, index):
    return ((int(word) & 0xFFFFFFFF) >> (4 * index)) & 0xF


def naive_awq(qweight, qzeros, scales, n, k, group_size):
    q = [[0] * n for _ in range(k)]
    z = [[0] * n for _ in range(k // group_size)]
    for table, packed in ((q, qweight), (z, qzeros)):
        for row in range(len(table)):
            for word in range(n // 8):
                for index in range(8):
                    column = 8 * word + AWQ_COLUMN_OF_NIBBLE[index]
                    table[row][column] = nibble(packed[row, word], index)
    out = torch.empty(n, k)
    for row in range(n):
        for col in range(k):
            group = col // group_size
            out[row, col] = (q[col][row] - z[group][row]) * float(scales[group, row])
    return out


def naive_ct(weight_packed, weight_scale, weight_zero_point, n, k, group_size):
    out = torch.empty(n, k)
    for row in range(n):
        for col in range(k):
            u = nibble(weight_packed[row, col // 8], col % 8)
            group = col // group_size
            if weight_zero_point is None:
                u_zero = 8
            else:
                u_zero = nibble(weight_zero_point[row // 8, group], row % 8)
            out[row, col] = (u - u_zero) * float(weight_scale[row, group])
    return out


def random_words(*shape, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**31), 2**31, shape, generator=generator, dtype=torch.int32)


def random_scales(*shape, seed, dtype):
    generator = torch.Generator().manual_seed(seed)
    return (torch.rand(*shape, generator=generator) * 0.1 + 1e-3).to(dtype)


@pytest.mark.parametrize(("n", "k", "group_size"), SHAPES)
def test_awq_dequantize_matches_naive_on_arbitrary_words(n, k, group_size):
    tensors = {
        "qweight": random_words(k, n // 8, seed=1),
        "qzeros": random_words(k // group_size, n // 8, seed=2),
        "scales": random_scales(k // group_size, n, seed=3, dtype=torch.float16),
    }
    weight = PackedInt4Weight("awq_gemm", n, k, group_size, tensors)
    expected = naive_awq(*tensors.values(), n, k, group_size)
    assert torch.equal(weight.dequantize(), expected)
    assert torch.equal(weight.dequantize(torch.bfloat16), expected.to(torch.bfloat16))


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize(("n", "k", "group_size"), SHAPES)
def test_ct_dequantize_matches_naive_on_arbitrary_words(n, k, group_size, symmetric):
    tensors = {
        "weight_packed": random_words(n, k // 8, seed=4),
        "weight_scale": random_scales(n, k // group_size, seed=5, dtype=torch.bfloat16),
    }
    zero_point = None if symmetric else random_words(n // 8, k // group_size, seed=6)
    if zero_point is not None:
        tensors["weight_zero_point"] = zero_point
    weight = PackedInt4Weight("compressed_tensors", n, k, group_size, tensors)
    expected = naive_ct(
        tensors["weight_packed"], tensors["weight_scale"], zero_point, n, k, group_size
    )
    assert torch.equal(weight.dequantize(), expected)


@pytest.mark.parametrize(("n", "k", "group_size"), SHAPES)
def test_awq_pack_matches_naive_and_round_trips(n, k, group_size):
    w = random_weight(n, k, seed=7)
    tensors = pack_awq_gemm(w, group_size)
    assert tensors["qweight"].dtype == tensors["qzeros"].dtype == torch.int32
    assert tensors["qweight"].shape == (k, n // 8)
    assert tensors["qzeros"].shape == (k // group_size, n // 8)
    assert tensors["scales"].shape == (k // group_size, n)
    assert tensors["scales"].dtype == torch.float16
    dequantized = PackedInt4Weight("awq_gemm", n, k, group_size, tensors).dequantize()
    naive = naive_awq(tensors["qweight"], tensors["qzeros"], tensors["scales"], n, k, group_size)
    assert torch.equal(dequantized, naive)
    step = tensors["scales"].float().repeat_interleave(group_size, dim=0).t()
    assert ((dequantized - w).abs() <= 0.5 * step * FP32_SLACK).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize(("n", "k", "group_size"), SHAPES)
def test_ct_pack_matches_naive_and_round_trips(n, k, group_size, symmetric, dtype):
    w = random_weight(n, k, seed=8, dtype=dtype)
    tensors = pack_compressed_tensors(w, group_size, symmetric)
    assert tensors["weight_packed"].dtype == torch.int32
    assert tensors["weight_packed"].shape == (n, k // 8)
    assert tensors["weight_scale"].shape == (n, k // group_size)
    assert tensors["weight_scale"].dtype == (torch.bfloat16 if dtype == torch.float32 else dtype)
    assert tensors["weight_shape"].tolist() == [n, k]
    assert ("weight_zero_point" in tensors) == (not symmetric)
    zero_point = tensors.get("weight_zero_point")
    if zero_point is not None:
        assert zero_point.dtype == torch.int32
        assert zero_point.shape == (n // 8, k // group_size)
    weight = PackedInt4Weight("compressed_tensors", n, k, group_size, tensors)
    dequantized = weight.dequantize()
    naive = naive_ct(
        tensors["weight_packed"], tensors["weight_scale"], zero_point, n, k, group_size
    )
    assert torch.equal(dequantized, naive)
    step = tensors["weight_scale"].float().repeat_interleave(group_size, dim=1)
    assert ((dequantized - w.float()).abs() <= 0.5 * step * FP32_SLACK).all()


@pytest.mark.parametrize("symmetric", [True, False])
def test_ct_round_trip_holds_for_groups_of_one_sign(symmetric):
    # compressed-tensors widens every range to include zero, so no group clips.
    w = random_weight(16, 64, seed=9).abs() + 0.5
    tensors = pack_compressed_tensors(w, 32, symmetric)
    dequantized = PackedInt4Weight("compressed_tensors", 16, 64, 32, tensors).dequantize()
    step = tensors["weight_scale"].float().repeat_interleave(32, dim=1)
    assert ((dequantized - w).abs() <= 0.5 * step * FP32_SLACK).all()


def test_nibble_order_on_known_words():
    # AWQ word 0x75316420: nibbles 0..7 hold 0,2,4,6,1,3,5,7 -> columns 0..7 read 0..7.
    awq = {
        "qweight": torch.full((8, 1), 0x75316420, dtype=torch.int32),
        "qzeros": torch.zeros(1, 1, dtype=torch.int32),
        "scales": torch.ones(1, 8, dtype=torch.float16),
    }
    awq_weight = PackedInt4Weight("awq_gemm", 8, 8, 8, awq).dequantize()
    assert awq_weight[:, 0].tolist() == list(range(8))
    # compressed-tensors word 0x76543210 with the +8 offset reads -8..-1 along K.
    ct = {
        "weight_packed": torch.full((1, 1), 0x76543210, dtype=torch.int32),
        "weight_scale": torch.ones(1, 1, dtype=torch.bfloat16),
    }
    ct_weight = PackedInt4Weight("compressed_tensors", 1, 8, 8, ct).dequantize()
    assert ct_weight[0].tolist() == list(range(-8, 0))


def write_checkpoint(tmp_path, tensors):
    save_file(
        {PREFIX + key: value for key, value in tensors.items()},
        tmp_path / "model.safetensors",
    )
    return TensorReader(tmp_path)


@pytest.mark.parametrize("with_config", [True, False])
@pytest.mark.parametrize("group_size", [16, 32])
def test_read_awq_from_safetensors(tmp_path, group_size, with_config):
    n, k = 40, 96
    tensors = pack_awq_gemm(random_weight(n, k, seed=10), group_size)
    reader = write_checkpoint(tmp_path, tensors)
    config = awq_quantization_config(group_size) if with_config else None
    weight = read_int4_weight(reader, PREFIX, "awq_gemm", config, n, k)
    assert (weight.format, weight.out_features, weight.in_features) == (
        "awq_gemm",
        n,
        k,
    )
    assert weight.group_size == group_size
    assert all(torch.equal(weight.tensors[key], tensors[key]) for key in tensors)
    expected = PackedInt4Weight("awq_gemm", n, k, group_size, tensors).dequantize()
    assert torch.equal(weight.dequantize(), expected)


@pytest.mark.parametrize("with_config", [True, False])
@pytest.mark.parametrize("symmetric", [True, False])
def test_read_ct_from_safetensors(tmp_path, symmetric, with_config):
    n, k, group_size = 24, 96, 32
    tensors = pack_compressed_tensors(random_weight(n, k, seed=11), group_size, symmetric)
    reader = write_checkpoint(tmp_path, tensors)
    config = compressed_tensors_quantization_config(group_size, symmetric) if with_config else None
    weight = read_int4_weight(reader, PREFIX, "compressed_tensors", config, n, k)
    assert weight.group_size == group_size
    assert ("weight_zero_point" in weight.tensors) == (not symmetric)
    expected = PackedInt4Weight("compressed_tensors", n, k, group_size, tensors)
    assert torch.equal(weight.dequantize(), expected.dequantize())


def test_read_ct_group_chosen_by_regex_target(tmp_path):
    tensors = pack_compressed_tensors(random_weight(24, 64, seed=12), 16, True)
    reader = write_checkpoint(tmp_path, tensors)
    config = compressed_tensors_quantization_config(16, True)
    config["config_groups"]["group_0"]["targets"] = ["re:.*mlp\\.up_proj$"]
    weight = read_int4_weight(reader, PREFIX, "compressed_tensors", config, 24, 64)
    assert weight.group_size == 16
    config["config_groups"]["group_0"]["targets"] = ["re:.*self_attn.*"]
    with pytest.raises(CheckpointError, match="no quantization_config group"):
        read_int4_weight(reader, PREFIX, "compressed_tensors", config, 24, 64)


def test_missing_qzeros_names_the_tensor(tmp_path):
    tensors = pack_awq_gemm(random_weight(24, 64, seed=13), 32)
    del tensors["qzeros"]
    reader = write_checkpoint(tmp_path, tensors)
    with pytest.raises(CheckpointError, match=f"{PREFIX}qzeros: missing"):
        read_int4_weight(reader, PREFIX, "awq_gemm", awq_quantization_config(32), 24, 64)


@pytest.mark.parametrize("with_config", [True, False])
def test_scales_with_wrong_shape_name_tensor_and_shapes(tmp_path, with_config):
    tensors = pack_awq_gemm(random_weight(24, 64, seed=14), 32)
    tensors["scales"] = torch.ones(2, 32, dtype=torch.float16)  # N is 24, not 32
    reader = write_checkpoint(tmp_path, tensors)
    config = awq_quantization_config(32) if with_config else None
    with pytest.raises(CheckpointError) as error:
        read_int4_weight(reader, PREFIX, "awq_gemm", config, 24, 64)
    assert f"{PREFIX}scales" in str(error.value)
    assert "(2, 24)" in str(error.value) and "(2, 32)" in str(error.value)


def test_config_group_size_disagreeing_with_scales_is_an_error(tmp_path):
    tensors = pack_awq_gemm(random_weight(24, 64, seed=15), 32)
    reader = write_checkpoint(tmp_path, tensors)
    with pytest.raises(CheckpointError, match=f"{PREFIX}scales: expected shape \\(4, 24\\)"):
        read_int4_weight(reader, PREFIX, "awq_gemm", awq_quantization_config(16), 24, 64)


def test_weight_packed_with_wrong_dtype_names_the_tensor(tmp_path):
    tensors = pack_compressed_tensors(random_weight(24, 64, seed=16), 32, True)
    tensors["weight_packed"] = tensors["weight_packed"].to(torch.int64)
    reader = write_checkpoint(tmp_path, tensors)
    config = compressed_tensors_quantization_config(32, True)
    with pytest.raises(CheckpointError, match=f"{PREFIX}weight_packed: .*torch.int64"):
        read_int4_weight(reader, PREFIX, "compressed_tensors", config, 24, 64)


def test_ct_inconsistencies_name_the_tensor(tmp_path):
    tensors = pack_compressed_tensors(random_weight(24, 64, seed=17), 32, True)
    reader = write_checkpoint(tmp_path, tensors)
    asymmetric = compressed_tensors_quantization_config(32, False)
    with pytest.raises(CheckpointError, match=f"{PREFIX}weight_zero_point: missing"):
        read_int4_weight(reader, PREFIX, "compressed_tensors", asymmetric, 24, 64)
    with pytest.raises(CheckpointError, match=f"{PREFIX}weight_shape: expected \\[24, 60\\]"):
        read_int4_weight(reader, PREFIX, "compressed_tensors", None, 24, 60)
    with pytest.raises(CheckpointError, match=f"{PREFIX}weight_packed: expected shape \\(24, 9\\)"):
        read_int4_weight(reader, PREFIX, "compressed_tensors", None, 24, 72)


@pytest.mark.parametrize(
    ("suffix", "expected"),
    [
        ("weight", "dense"),
        ("qweight", "awq_gemm"),
        ("weight_packed", "compressed_tensors"),
    ],
)
def test_detect_linear_format(tmp_path, suffix, expected):
    reader = write_checkpoint(tmp_path, {suffix: torch.zeros(8, 1, dtype=torch.int32)})
    assert detect_linear_format(reader, PREFIX) == expected


def test_detect_linear_format_without_weights_names_prefix(tmp_path):
    reader = write_checkpoint(tmp_path, {"bias": torch.zeros(8)})
    with pytest.raises(CheckpointError, match=PREFIX):
        detect_linear_format(reader, PREFIX)
