"""Compile every Triton kernel launch of the fast path for an H100/H200 (sm_90), on a CPU.

The CPU tests run the kernels in Triton's interpreter, which executes the Python body and never
compiles it: code the GPU compiler rejects (a helper returning two types, an unsupported
construct) passes there and fails only on a GPU. Here each kernel wrapper is called with small
CPU tensors while `JITFunction.run` is replaced by a compile for sm_90 (Triton's frontend,
its GPU passes and ptxas, all bundled with Triton; no driver needed): the launch is built, typed
and compiled, never run. The matmul is compiled in the tuned configurations of
`row_matmul_configs.json` too. Not covered: the specialisation hints a real launch adds
(arguments divisible by 16, integers equal to 1), which steer some GPU passes. Must run with
TRITON_INTERPRET=0 (its own process); prints one line per compiled kernel and exits non-zero on
the first failure.

    TRITON_INTERPRET=0 python -m tests.compile_kernels_for_gpu [--broken]
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import os
import sys

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

HOPPER = GPUTarget("cuda", 90, 32)
LAUNCH_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion", "launch_pdl")
POINTER_TYPES = {
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.float32: "*fp32",
    torch.int32: "*i32",
    torch.int64: "*i64",
    torch.uint8: "*u8",
}


def argument_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return POINTER_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def compile_instead_of_launch(self: JITFunction, *args, grid, warmup, **kwargs):
    options = {name: kwargs.pop(name) for name in LAUNCH_OPTIONS if name in kwargs}
    bound = inspect.signature(self.fn).bind(*args, **kwargs)
    bound.apply_defaults()
    names = list(bound.arguments)
    constexpr_names = {param.name for param in self.params if param.is_constexpr}
    signature, constexprs = {}, {}
    for index, (name, value) in enumerate(bound.arguments.items()):
        if name in constexpr_names or value is None:
            signature[name] = "constexpr"
            constexprs[(index,)] = value
        else:
            signature[name] = argument_type(value)
    source = ASTSource(fn=self, signature=signature, constexprs=constexprs)
    triton.compile(source, target=HOPPER, options=options)
    shown = {names[i[0]]: v for i, v in constexprs.items() if isinstance(v, (bool, int))}
    print(f"compiled {self.fn.__name__} {shown}", flush=True)


def launch_every_variant() -> None:
    """The launches the engines make: each kernel in each of its compiled variants."""
    from dflash_serve.kernels.attention_inputs import attention_inputs_into_cache
    from dflash_serve.kernels.block_attention import block_attention
    from dflash_serve.kernels.norm_rotary import norm_rotary
    from dflash_serve.kernels.rms_norm import add_rms_norm, gated_rms_norm, rms_norm
    from dflash_serve.kernels.row_matmul import (
        WIDE_MIN_ROWS,
        MatmulConfig,
        matmul_config,
        row_matmul,
        tuned_configs,
    )
    from dflash_serve.kernels.silu_mul import silu_mul
    from dflash_serve.kernels.w4a16_matmul import (
        PlanarInt4,
        W4A16Config,
        tuned_launches,
        w4a16_matmul,
    )
    from dflash_serve.layers.split_sums import SplitSums
    from target_service.kernels.gated_delta_recurrence import recurrent_gated_delta
    from target_service.kernels.gdn_inputs import prepare_gdn_inputs, prepare_gdn_prefill_inputs
    from tests import test_kernel_block_attention as attention_tests
    from tests import test_kernel_gated_delta_recurrence as recurrence_tests
    from tests import test_kernel_gdn_inputs as gdn_tests
    from tests import test_kernel_row_matmul as matmul_tests
    from tests import test_kernel_w4a16_matmul as w4a16_tests

    n, k = matmul_tests.SHAPES[1]
    x = matmul_tests.random_rows(20, k, seed=0)
    weight = matmul_tests.make_weight(n, k)
    base = matmul_config(n, k)
    tilings = ((16, 1), (16, 4), (16, 8), (64, 1), (64, 2))
    for (block_m, row_tiles), swap_ab in itertools.product(tilings, (False, True)):
        for split_k in sorted({1, base.split_k}):
            per_split = k if split_k == 1 else base.k_per_split
            config = dataclasses.replace(
                base, block_m=block_m, row_tiles=row_tiles, split_k=split_k,
                k_per_split=per_split, swap_ab=swap_ab,
            )  # fmt: skip
            row_matmul(x, weight, config=config)
    for key, tuned in tuned_configs().items():  # the configurations the H200 runs
        n, k = (int(size) for size in key.split(":")[1].split("x"))
        x = torch.empty(16, k, dtype=torch.bfloat16)  # never touched: nothing runs
        row_matmul(x, torch.empty(n, k, dtype=torch.bfloat16), config=MatmulConfig(**tuned))
        wide_x = torch.empty(WIDE_MIN_ROWS, k, dtype=torch.bfloat16)  # the wide launch
        row_matmul(wide_x, torch.empty(n, k, dtype=torch.bfloat16), config=MatmulConfig(**tuned))
    # W4A16: each group size's planes-per-group path, a ragged K, 16/32/64-row tiles, split-K
    # 1 and > 1, programs of 32 outputs, then every tuned configuration.
    for shape in w4a16_tests.SHAPES:
        weight, _, config = w4a16_tests.planar_case("awq", shape)
        x = w4a16_tests.random_rows(20, shape[1], seed=0)
        w4a16_matmul(x, weight, config=config)
    weight, _, _ = w4a16_tests.planar_case("awq", (64, 1280, 128))
    x = w4a16_tests.random_rows(20, 1280, seed=0)
    for block_m, tiles_per_split in itertools.product((16, 32, 64), (5, 2)):
        config = W4A16Config.over_splits(weight.num_tiles, tiles_per_split, block_n=64,
                                         block_m=block_m)  # fmt: skip
        w4a16_matmul(x, weight, config=config)
    for block_m in (16, 64):  # 32 outputs a program (mma.sync): a tuner candidate
        config = W4A16Config.over_splits(weight.num_tiles, 5, block_n=32, block_m=block_m)
        w4a16_matmul(x, weight, config=config)
    for key, launches in tuned_launches().items():  # each row bucket's launch
        n, k = (int(size) for size in key.split(":")[0].split("x"))
        group = int(key.split(":g")[1])
        weight = PlanarInt4(
            words=torch.empty(k // 8, n, dtype=torch.int32),
            scales=torch.empty(k // group, n),
            zeros=torch.empty(k // group, n, dtype=torch.uint8),
            out_features=n,
            in_features=k,
            group_size=group,
        )
        for config in launches:
            w4a16_matmul(torch.empty(16, k, dtype=torch.bfloat16), weight, config=config)
        w4a16_matmul(torch.empty(WIDE_MIN_ROWS, k, dtype=torch.bfloat16), weight)  # wide
    rows = torch.randn(4, 64, dtype=torch.bfloat16)
    for zero_centred in (False, True):
        rms_norm(rows, torch.ones(64), 1e-6, zero_centred)
    gated_rms_norm(rows, rows, torch.ones(64), 1e-6)
    add_rms_norm(rows, rows, torch.ones(64), 1e-6, True)
    for splits in (2, 4, 8):  # a residual add summing a down projection's split-K partials
        partials = SplitSums(torch.randn(splits, 4, 64), (4, 64))
        add_rms_norm(rows, partials, torch.ones(64), 1e-6, True)
    silu_mul(rows, rows)
    for head_dim, rotary_dim, zero_centred in (
        (256, 64, True),
        (128, 128, False),
    ):  # target, drafter
        heads = torch.randn(16, 4, head_dim, dtype=torch.bfloat16)
        cos = torch.randn(16, rotary_dim)
        norm_rotary(heads, torch.ones(head_dim), 1e-6, zero_centred, cos, cos)
    # The 4B drafter's block rows and context rows; Qwen3.5-4B's verify rows (gated queries).
    for q_heads, q_stride, kv_heads, head_dim, rotary_dim, zero_centred in (
        (32, 128, 8, 128, 128, False),
        (0, 128, 8, 128, 128, False),
        (16, 512, 4, 256, 64, True),
    ):
        qkv = torch.randn(2, 16, q_heads * q_stride + 2 * kv_heads * head_dim, dtype=torch.bfloat16)
        cache = torch.zeros(4, 64, kv_heads, head_dim, dtype=torch.bfloat16)
        cos = torch.randn(2, 16, rotary_dim)
        weight = torch.ones(head_dim)
        attention_inputs_into_cache(
            qkv, q_heads, weight, weight, 1e-6, zero_centred, cos, cos, cache, cache,
            torch.tensor([1, 3]), torch.arange(32).reshape(2, 16), query_stride=q_stride,
        )  # fmt: skip
    for heads, kv_heads, head_dim in ((16, 4, 256), (32, 8, 128)):
        q, key_cache, value_cache, slots, starts = attention_tests.random_problem(
            heads, kv_heads, head_dim, 16, [3, 40]
        )
        for causal, window in ((True, None), (False, 64), (True, 64)):
            block_attention(q, key_cache, value_cache, slots, starts, 0.1, causal=causal,
                            window=window)  # fmt: skip
    gates = attention_tests.strided_gates(q, seed=0)  # a gated output, as the target verifies
    block_attention(q, key_cache, value_cache, slots, starts, 0.1, gate=gates)
    inputs = gdn_tests.make_inputs(2, 16, torch.bfloat16, seed=0)
    prepare_gdn_inputs(**inputs, **gdn_tests.make_outputs(inputs))
    gdn_tests.run_prefill(prepare_gdn_prefill_inputs, inputs)  # no block record
    split, _ = gdn_tests.as_split_sums(inputs, seed=0)  # b and a as partial sums
    prepare_gdn_inputs(**split, **gdn_tests.make_outputs(inputs))
    q, k_, v, g, beta, pool = recurrence_tests.make_inputs(2, 16, 2, 4, 128, 128, torch.bfloat16, 0)
    slots = torch.tensor([1, 3])
    recurrent_gated_delta(q, k_, v, g, beta, pool, pool, slots, out=torch.empty(v.shape))
    bf16_out = torch.empty(v.shape, dtype=torch.bfloat16)  # the target's verify writes bf16
    recurrent_gated_delta(q, k_, v, g, beta, pool, pool, slots, out=bf16_out)
    replayed = torch.tensor([5, 16], dtype=torch.int32)
    recurrent_gated_delta(k_.float(), k_.float(), v.float(), g, beta, pool, pool, slots, replayed)


@triton.jit
def _mismatched_returns(x_ptr, IS_INT: tl.constexpr):
    """The mistake this check exists for: the interpreter runs it, the GPU compiler rejects it
    (the code after a constexpr branch's return is still compiled, and returns another type)."""
    if IS_INT:
        return tl.load(x_ptr).to(tl.int32)
    return tl.load(x_ptr)


@triton.jit
def _broken_kernel(x_ptr):
    tl.store(x_ptr, _mismatched_returns(x_ptr, True).to(tl.float32))


def main() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") != "0":
        sys.exit("run with TRITON_INTERPRET=0: the interpreter never compiles")
    JITFunction.run = compile_instead_of_launch
    if sys.argv[1:] == ["--broken"]:  # the test's proof that a bad kernel fails here
        _broken_kernel[(1,)](torch.zeros(1))
        return
    launch_every_variant()


if __name__ == "__main__":
    main()
