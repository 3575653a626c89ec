"""Every fast-path kernel compiles for an H100/H200 (sm_90), checked on the CPU.

The interpreter runs of tests/test_kernel_*.py prove the kernels' arithmetic but never compile
them; this compiles each launch the engines make (tests/compile_kernels_for_gpu.py, in its own
process since the interpreter must be off). A second run on a deliberately broken kernel shows
the check fails where a GPU compile would.
"""

from __future__ import annotations

import os
import subprocess
import sys

from dflash_serve.kernels.row_matmul import tuned_configs
from dflash_serve.kernels.w4a16_matmul import tuned_launches as w4a16_tuned_launches
from tests.test_kernel_w4a16_matmul import SHAPES as W4A16_SHAPES

KERNELS = [
    "_row_matmul_kernel",
    "_wide_matmul_kernel",
    "_sum_splits_kernel",
    "_w4a16_kernel",
    "_rms_norm_kernel",
    "_gated_rms_norm_kernel",
    "_add_rms_norm_kernel",
    "_silu_mul_kernel",
    "_norm_rotary_kernel",
    "_attention_inputs_kernel",
    "_split_attention_kernel",
    "_combine_splits_kernel",
    "_gdn_inputs_kernel",
    "_recurrent_gated_delta_kernel",
]


def compile_for_gpu(*args: str) -> subprocess.CompletedProcess:
    env = os.environ | {"TRITON_INTERPRET": "0"}
    command = [sys.executable, "-m", "tests.compile_kernels_for_gpu", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)


def test_every_kernel_compiles_for_sm90():
    result = compile_for_gpu()
    assert result.returncode == 0, result.stderr[-3000:]
    compiled = {
        line.split()[1] for line in result.stdout.splitlines() if line.startswith("compiled")
    }
    assert compiled == set(KERNELS)
    row_matmul_variants = [
        line for line in result.stdout.splitlines() if "_row_matmul_kernel" in line
    ]
    # (16-row tiles 1/4/8 per program, 64-row tiles 1/2) × split-K 1/3 × plain and swapped
    # operands, then every tuned configuration
    assert len(row_matmul_variants) == 20 + len(tuned_configs())
    w4a16_variants = [line for line in result.stdout.splitlines() if "_w4a16_kernel" in line]
    # the test shapes, 16/32/64-row tiles × two splits, 32-wide programs of 16 and 64 rows,
    # then every tuned configuration and each tuned shape's wide launch
    tuned = sum(len(launches) for launches in w4a16_tuned_launches().values())
    assert len(w4a16_variants) == len(W4A16_SHAPES) + 6 + 2 + tuned + len(w4a16_tuned_launches())
    wide_variants = [line for line in result.stdout.splitlines() if "_wide_matmul_kernel" in line]
    assert len(wide_variants) == len(tuned_configs())
    assert sum("'BLOCK_N': 32," in line for line in w4a16_variants) >= 2


def test_a_kernel_the_gpu_compiler_rejects_fails_the_check():
    result = compile_for_gpu("--broken")
    assert result.returncode != 0
    assert "_mismatched_returns" in result.stderr
