"""The fused GDN input kernel (conv + SiLU, gates, block record) against a naive fp32 oracle.

Closeness to the oracle: conv_out within one ulp of bf16 (four of fp32, see
`assert_within_ulps`), decay and beta within 1e-6 relative; the oracle writes the same formulas
with torch's exp, log1p and softplus, the kernel uses numpy's (interpreter) or libdevice's
(GPU). The copies and row independence are bit-exact and checked with torch.equal: the record
must hold exactly what the recurrence consumed, and a token's result must not depend on the
launch (T tokens at once or one at a time, a sequence alone or in a batch).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash_serve.layers.split_sums import SplitSums
from target_service.kernels.gdn_inputs import (
    prepare_gdn_inputs,
    prepare_gdn_inputs_reference,
    prepare_gdn_prefill_inputs,
    prepare_gdn_prefill_inputs_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUM_SLOTS, MAX_TOKENS, WIDTH = 4, 16, 4
KEY_HEAD_DIM = 16  # block_keys is a [S, Tmax, Hk, Dk] pool viewed flat
KEY_DIM, VALUE_DIM, HEADS = 32, 48, 4
POOLS = ("block_conv_inputs", "block_keys", "block_values", "block_decays", "block_betas")


def make_inputs(batch, tokens, dtype, seed, key_dim=KEY_DIM, value_dim=VALUE_DIM, heads=HEADS,
                num_slots=NUM_SLOTS, slots=None, state_dtype=None, device=DEVICE):  # fmt: skip
    """Keyword arguments of prepare_gdn_inputs; conv_inputs, a, b are slices of one [B, T, P]."""
    gen = torch.Generator().manual_seed(seed)
    channels = 2 * key_dim + value_dim
    wide = torch.cat(
        (
            torch.randn(batch, tokens, channels, generator=gen),
            3 * torch.randn(batch, tokens, 2 * heads, generator=gen),
            torch.randn(batch, tokens, 5, generator=gen),
        ),
        dim=-1,
    ).to(dtype)
    dt_bias = torch.randn(heads, generator=gen)
    dt_bias[0], dt_bias[1] = 25.0, -12.0  # softplus above its threshold, and a tiny log1p
    states = torch.randn(num_slots, channels, WIDTH - 1, generator=gen)
    inputs = dict(
        conv_inputs=wide[..., :channels],
        a=wide[..., channels : channels + heads],
        b=wide[..., channels + heads : channels + 2 * heads],
        conv_states=states.to(state_dtype or dtype),
        conv_weight=(0.5 * torch.randn(channels, 1, WIDTH, generator=gen)).to(dtype)[:, 0],
        A_log=0.5 * torch.randn(heads, generator=gen),
        dt_bias=dt_bias,
        slots=torch.tensor(slots if slots is not None else list(range(batch))[::-1]),
    )
    return {name: x.to(device) for name, x in inputs.items()} | dict(key_dim=key_dim)


def make_outputs(inputs, pool_dtype=None, max_tokens=MAX_TOKENS):
    """NaN outputs and random pools (so untouched entries are checkable)."""
    x, heads, key_dim = inputs["conv_inputs"], inputs["A_log"].shape[0], inputs["key_dim"]
    num_slots, channels = inputs["conv_states"].shape[:2]
    gen = torch.Generator().manual_seed(99)
    pool = (num_slots, max_tokens)
    keys = torch.randn(*pool, key_dim // KEY_HEAD_DIM, KEY_HEAD_DIM, generator=gen)
    outputs = dict(
        conv_out=torch.full(x.shape, float("nan"), dtype=x.dtype),
        decay=torch.full((*x.shape[:2], heads), float("nan")),
        beta=torch.full((*x.shape[:2], heads), float("nan")),
        block_conv_inputs=torch.randn(*pool, channels, generator=gen).to(pool_dtype or x.dtype),
        block_keys=keys.flatten(2),
        block_values=torch.randn(*pool, channels - 2 * key_dim, generator=gen),
        block_decays=torch.randn(*pool, heads, generator=gen),
        block_betas=torch.randn(*pool, heads, generator=gen),
    )
    return {name: t.to(x.device) for name, t in outputs.items()}


def run(fn, inputs, pool_dtype=None):
    outputs = make_outputs(inputs, pool_dtype)
    fn(**inputs, **outputs)
    return outputs


PREFILL_OUTPUTS = ("conv_out", "decay", "beta")


def run_prefill(fn, inputs):
    """The prefill variant: no key_dim, no block pools; returns its three outputs."""
    outputs = {name: make_outputs(inputs)[name] for name in PREFILL_OUTPUTS}
    fn(**{name: x for name, x in inputs.items() if name != "key_dim"}, **outputs)
    return outputs


def naive(conv_inputs, a, b, conv_states, conv_weight, A_log, dt_bias, slots, key_dim):
    """(conv_out rounded to conv_inputs' dtype, decay, beta), token by token and tap by tap."""
    x, weight = conv_inputs.float(), conv_weight.float()
    history = conv_states[slots].to(conv_inputs.dtype).float()
    width = weight.shape[1]
    outputs = []
    for t in range(x.shape[1]):
        acc = None
        for j in range(width):
            pos = t + j - (width - 1)
            tap = (history[:, :, t + j] if pos < 0 else x[:, pos]) * weight[:, j]
            acc = tap if acc is None else acc + tap
        outputs.append(acc * (1.0 / (1.0 + torch.exp(-acc))))
    conv_out = torch.stack(outputs, dim=1).to(conv_inputs.dtype)
    decay = -torch.exp(A_log) * F.softplus(a.float() + dt_bias)
    return conv_out, decay, torch.sigmoid(b.float())


def assert_within_ulps(actual, expected):
    """bf16: one ulp. fp32: four, stated here rather than hidden: numpy's exp (interpreter),
    libdevice's (GPU) and torch's (oracle) differ by up to 2 ulp, and 1/(1+e) then ×x carry
    that to up to 3 ulp of silu (measured on CPU); rounding to bf16 absorbs it but for a tie.
    """
    max_ulps = 1 if expected.dtype == torch.bfloat16 else 4
    inf = torch.tensor(float("inf"), dtype=expected.dtype, device=expected.device)
    ulp = (torch.nextafter(expected.abs(), inf) - expected.abs()).float()
    gap = (actual.float() - expected.float()).abs()
    assert (gap <= max_ulps * ulp).all(), f"max gap {gap.max()} (in ulps: {(gap / ulp).max()})"


def check_conv_and_gates(inputs, outputs):
    """conv_out, decay and beta (on any device) against the naive oracle on the CPU."""
    cpu = {name: x.cpu() if torch.is_tensor(x) else x for name, x in inputs.items()}
    conv_out, decay, beta = naive(**cpu)
    assert_within_ulps(outputs["conv_out"].cpu(), conv_out)
    torch.testing.assert_close(outputs["decay"].cpu(), decay, rtol=1e-6, atol=0)
    torch.testing.assert_close(outputs["beta"].cpu(), beta, rtol=1e-6, atol=0)


def check_against_naive(inputs, outputs, pool_dtype=None):
    slots, key_dim = inputs["slots"], inputs["key_dim"]
    conv_out, decay, beta = naive(**inputs)
    assert_within_ulps(outputs["conv_out"], conv_out)
    torch.testing.assert_close(outputs["decay"], decay, rtol=1e-6, atol=0)
    torch.testing.assert_close(outputs["beta"], beta, rtol=1e-6, atol=0)
    tokens = conv_out.shape[1]
    record = {name: outputs[name][slots, :tokens] for name in POOLS}
    x = inputs["conv_inputs"]
    assert torch.equal(record["block_conv_inputs"], x.to(record["block_conv_inputs"].dtype))
    conv_out = outputs["conv_out"].float()
    assert torch.equal(record["block_keys"], conv_out[..., key_dim : 2 * key_dim])
    assert torch.equal(record["block_values"], conv_out[..., 2 * key_dim :])
    assert torch.equal(record["block_decays"], outputs["decay"])
    assert torch.equal(record["block_betas"], outputs["beta"])
    before = make_outputs(inputs, pool_dtype)
    written = torch.zeros(NUM_SLOTS, MAX_TOKENS, dtype=torch.bool)
    written[slots.cpu(), :tokens] = True
    for name in POOLS:
        assert torch.equal(outputs[name][~written], before[name][~written]), name


SHAPES = [
    # (batch, tokens, slots)
    (1, 1, [2]),
    (3, 5, [3, 0, 1]),
    (1, 16, [1]),
    (3, 16, [2, 0, 3]),
]


@pytest.mark.parametrize("fn", [prepare_gdn_inputs, prepare_gdn_inputs_reference])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("batch", "tokens", "slot_list"), SHAPES)
def test_matches_naive(fn, dtype, batch, tokens, slot_list):
    inputs = make_inputs(batch, tokens, dtype, seed=batch * 17 + tokens, slots=slot_list)
    states = inputs["conv_states"].clone()
    outputs = run(fn, inputs)
    check_against_naive(inputs, outputs)
    assert torch.equal(inputs["conv_states"], states)


def test_pools_in_other_dtypes_are_read_and_written_through_rounding():
    inputs = make_inputs(2, 4, torch.float32, seed=3, slots=[1, 3], state_dtype=torch.bfloat16)
    outputs = run(prepare_gdn_inputs, inputs, pool_dtype=torch.bfloat16)
    check_against_naive(inputs, outputs, pool_dtype=torch.bfloat16)


def test_several_channel_blocks_with_k_crossing_a_block_edge():
    inputs = make_inputs(2, 3, torch.bfloat16, seed=4, key_dim=608, value_dim=1000, slots=[0, 2])
    outputs = run(prepare_gdn_inputs, inputs)
    conv_out, _, _ = naive(**inputs)
    assert_within_ulps(outputs["conv_out"], conv_out)
    record = outputs["conv_out"][:, :, 608:].float()
    assert torch.equal(outputs["block_keys"][[0, 2], :3], record[..., :608])
    assert torch.equal(outputs["block_values"][[0, 2], :3], record[..., 608:])


def check_block_equals_chained(inputs):
    """A T-token call == T one-token calls with the conv state advanced between them."""
    block = run(prepare_gdn_inputs, inputs)
    slots, states = inputs["slots"], inputs["conv_states"].clone()
    for t in range(inputs["conv_inputs"].shape[1]):
        step = {name: inputs[name][:, t : t + 1] for name in ("conv_inputs", "a", "b")}
        single = run(prepare_gdn_inputs, inputs | step | dict(conv_states=states))
        for name in ("conv_out", "decay", "beta"):
            assert torch.equal(single[name], block[name][:, t : t + 1]), (name, t)
        for name in POOLS:
            assert torch.equal(single[name][slots, 0], block[name][slots, t]), (name, t)
        newest = step["conv_inputs"].transpose(1, 2).to(states.dtype)
        states[slots] = torch.cat((states[slots], newest), dim=-1)[..., 1:]


def check_row_alone_equals_batched(inputs):
    batched = run(prepare_gdn_inputs, inputs)
    slots = inputs["slots"]
    for row in range(len(slots)):
        alone = {name: inputs[name][row : row + 1] for name in ("conv_inputs", "a", "b", "slots")}
        single = run(prepare_gdn_inputs, inputs | alone)
        for name in ("conv_out", "decay", "beta"):
            assert torch.equal(single[name][0], batched[name][row]), (name, row)
        for name in POOLS:
            assert torch.equal(single[name][slots[row]], batched[name][slots[row]]), (name, row)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_block_equals_chained_single_tokens(dtype):
    check_block_equals_chained(make_inputs(2, 16, dtype, seed=5, slots=[2, 0]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_alone_equals_row_in_batch(dtype):
    check_row_alone_equals_batched(make_inputs(3, 5, dtype, seed=6, slots=[3, 0, 1]))


def _bad(name):
    inputs = make_inputs(2, 3, torch.float32, seed=0, slots=[2, 0])
    args = inputs | make_outputs(inputs)
    x = args["conv_inputs"]
    bad = {
        "conv_inputs": x[0],
        "a": args["a"][:, :, :3],
        "b": args["b"].to(torch.bfloat16),
        "conv_states": args["conv_states"][:, :, :2],
        "conv_weight": args["conv_weight"][:-1],
        "A_log": args["A_log"].to(torch.bfloat16),
        "dt_bias": args["dt_bias"][:3],
        "slots": args["slots"].to(torch.int32),
        "key_dim": 56,
        "conv_out": args["conv_out"].to(torch.bfloat16),
        "decay": args["decay"][:, :2],
        "beta": args["beta"].transpose(1, 2).contiguous().transpose(1, 2),
        "block_conv_inputs": args["block_conv_inputs"][:, :2],
        "block_keys": args["block_keys"][:, :, :16],
        "block_values": args["block_values"].double(),
        "block_decays": args["block_decays"][:3],
        "block_betas": args["block_betas"][:, :, :2],
    }
    args[name] = bad[name]
    return args


@pytest.mark.parametrize("name", list(_bad("a")))
@pytest.mark.parametrize("fn", [prepare_gdn_inputs, prepare_gdn_inputs_reference])
def test_bad_arguments_raise_value_error_naming_them(fn, name):
    with pytest.raises(ValueError, match=rf"^{name} "):
        fn(**_bad(name))


@pytest.mark.parametrize("fn", [prepare_gdn_prefill_inputs, prepare_gdn_prefill_inputs_reference])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_variant_matches_naive_on_chunks_longer_than_a_block(fn, dtype):
    inputs = make_inputs(2, 3 * MAX_TOKENS - 5, dtype, seed=21, slots=[3, 1])
    states = inputs["conv_states"].clone()
    outputs = run_prefill(fn, inputs)
    check_conv_and_gates(inputs, outputs)
    assert torch.equal(inputs["conv_states"], states)  # the caller advances it


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_variant_gives_the_verify_variants_bits(dtype):
    inputs = make_inputs(3, MAX_TOKENS, dtype, seed=5, slots=[2, 0, 3])
    verify = run(prepare_gdn_inputs, inputs)
    prefill = run_prefill(prepare_gdn_prefill_inputs, inputs)
    for name in PREFILL_OUTPUTS:
        assert torch.equal(prefill[name], verify[name]), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_qwen35_4b_shapes_on_gpu():
    slots = [5, 0, 7, 2, 1, 6, 3, 4]
    inputs = make_inputs(8, 16, torch.bfloat16, seed=10, key_dim=2048, value_dim=4096,
                         heads=32, num_slots=8, slots=slots, device="cuda")  # fmt: skip
    outputs = run(prepare_gdn_inputs, inputs)
    check_conv_and_gates(inputs, outputs)
    check_block_equals_chained(inputs)
    check_row_alone_equals_batched(inputs)

    captured = make_outputs(inputs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        prepare_gdn_inputs(**inputs, **captured)
    graph.replay()
    for name, tensor in outputs.items():
        assert torch.equal(captured[name], tensor), name


@pytest.mark.parametrize(
    "name", [name for name in _bad("a") if name != "key_dim" and not name.startswith("block_")]
)
@pytest.mark.parametrize("fn", [prepare_gdn_prefill_inputs, prepare_gdn_prefill_inputs_reference])
def test_prefill_variant_bad_arguments_raise_value_error_naming_them(fn, name):
    args = _bad(name)
    args = {key: x for key, x in args.items() if key != "key_dim" and not key.startswith("block_")}
    with pytest.raises(ValueError, match=rf"^{name} "):
        fn(**args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prefill_variant_at_qwen35_4b_shapes_on_gpu():
    inputs = make_inputs(1, 300, torch.bfloat16, seed=11, key_dim=2048, value_dim=4096,
                         heads=32, num_slots=3, slots=[2], device="cuda")  # fmt: skip
    outputs = run_prefill(prepare_gdn_prefill_inputs, inputs)
    check_conv_and_gates(inputs, outputs)


def as_split_sums(inputs, seed, splits=5):
    """`inputs` with a and b as split-K partial sums (`SplitSums`: the two halves of one
    matmul's random fp32 partials), beside the same call on the bf16 tensors they stand for."""
    batch, tokens, _ = inputs["conv_inputs"].shape
    heads = inputs["A_log"].shape[0]
    gen = torch.Generator().manual_seed(seed)
    partials = 3 * torch.randn(splits, batch * tokens, 2 * heads + 3, generator=gen)
    gates = SplitSums(partials.to(DEVICE), (batch, tokens, 2 * heads + 3))
    split = dict(a=gates.columns(0, heads), b=gates.columns(heads, 2 * heads))
    summed = {name: sums.total() for name, sums in split.items()}
    return inputs | split, inputs | summed


@pytest.mark.parametrize(
    ("fn", "prefill"),
    [
        (prepare_gdn_inputs, prepare_gdn_prefill_inputs),
        (prepare_gdn_inputs_reference, prepare_gdn_prefill_inputs_reference),
    ],
)
def test_split_k_gates_give_the_summed_gates_bits(fn, prefill):
    """a and b left as their matmul's partial sums: every output and record bit for bit
    those of the same call on the sums (`SplitSums.total`: split order, one rounding to
    bf16), in the verify and the prefill variant."""
    inputs = make_inputs(2, MAX_TOKENS, torch.bfloat16, seed=11, slots=[3, 1])
    split, summed = as_split_sums(inputs, seed=12)
    from_split, from_summed = run(fn, split), run(fn, summed)
    for name, tensor in from_summed.items():
        assert torch.equal(from_split[name], tensor), name
    for name, tensor in run_prefill(prefill, split).items():
        assert torch.equal(tensor, from_summed[name]), name


def test_gates_from_two_matmuls_are_refused():
    inputs = make_inputs(1, 4, torch.bfloat16, seed=13)
    split, _ = as_split_sums(inputs, seed=14)
    other, _ = as_split_sums(inputs, seed=15, splits=3)
    with pytest.raises(ValueError, match="one matmul"):
        run(prepare_gdn_inputs, split | {"b": other["b"]})
