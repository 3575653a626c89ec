"""Programmatic dependent launch is safe only if every kernel waits before touching memory.

Under PDL (`dflash_serve.kernels.programmatic_launch`) a kernel's programs may start while the
kernel before it still runs. A kernel launched so that reads its input, or writes a buffer the
previous kernel still reads, before `wait_for_inputs()` races with it: outputs would differ
from run to run, rarely, on the GPU only. So each kernel's body must begin with the wait; this
checks the source of every kernel the serving path launches (the GPU tests then prove the
outputs bit-identical with PDL on).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap

import pytest

from dflash_serve import kernels

KERNEL_MODULES = [
    "dflash_serve.kernels.attention_inputs",
    "dflash_serve.kernels.block_attention",
    "dflash_serve.kernels.norm_rotary",
    "dflash_serve.kernels.rms_norm",
    "dflash_serve.kernels.row_matmul",
    "dflash_serve.kernels.silu_mul",
    "dflash_serve.kernels.w4a16_matmul",
    "target_service.kernels.gated_delta_recurrence",
    "target_service.kernels.gdn_inputs",
]


def launched_kernels() -> list[tuple[str, object]]:
    """Every `_..._kernel` JIT function of the kernel modules (helpers are not launched)."""
    found = []
    for module_name in KERNEL_MODULES:
        module = importlib.import_module(module_name)
        for name, value in vars(module).items():
            function = getattr(value, "fn", None)
            if name.endswith("_kernel") and function is not None:
                found.append((f"{module_name}.{name}", function))
    return found


def first_statement(function) -> ast.stmt:
    body = ast.parse(textwrap.dedent(inspect.getsource(function))).body[0].body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    return body[0]


def is_wait_call(statement: ast.stmt) -> bool:
    return (
        isinstance(statement, ast.Expr)
        and isinstance(statement.value, ast.Call)
        and getattr(statement.value.func, "id", None) == "wait_for_inputs"
    )


def test_every_launched_kernel_is_found():
    names = {name.rsplit(".", 1)[1] for name, _ in launched_kernels()}
    expected = {"_w4a16_kernel", "_row_matmul_kernel", "_recurrent_gated_delta_kernel"}
    assert expected | {"_wide_matmul_kernel", "_wide_tma_matmul_kernel"} <= names
    assert len(names) == 15


@pytest.mark.parametrize(
    "name, function", launched_kernels(), ids=[name for name, _ in launched_kernels()]
)
def test_kernel_waits_before_anything_else(name, function):
    assert is_wait_call(first_statement(function)), f"{name} must begin with wait_for_inputs()"


def test_a_kernel_that_loads_first_is_caught():
    def _bad_kernel(x_ptr):
        value = x_ptr + 1  # noqa: F841 (stands for a load before the wait)

    def _good_kernel(x_ptr):
        """Docstring first is fine."""
        wait_for_inputs()  # noqa: F821

    assert not is_wait_call(first_statement(_bad_kernel))
    assert is_wait_call(first_statement(_good_kernel))


@pytest.mark.parametrize(
    "setting, has_cuda, capability, expected",
    [
        ("1", True, (9, 0), True),
        ("1", True, (10, 0), True),
        ("1", True, (8, 9), False),
        ("1", False, None, False),
        ("0", True, (9, 0), False),
    ],
)
def test_programmatic_launch_needs_hopper_and_can_be_turned_off(
    monkeypatch, setting, has_cuda, capability, expected
):
    monkeypatch.setenv("DFLASH_PDL", setting)
    monkeypatch.setattr("torch.cuda.is_available", lambda: has_cuda)
    monkeypatch.setattr("torch.cuda.get_device_capability", lambda *args: capability)
    kernels.programmatic_launch.cache_clear()
    try:
        assert kernels.programmatic_launch() is expected
    finally:
        kernels.programmatic_launch.cache_clear()
