"""Triton kernels shared by the target and the drafter, each beside its plain-torch reference.

Triton is a GPU dependency: nothing here is imported on the plain-torch (CPU) path. The tests
also run the kernels on CPU through Triton's interpreter (`TRITON_INTERPRET=1`).
"""

from __future__ import annotations

import importlib.util
import os


def is_triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def is_interpreting() -> bool:
    """True under Triton's CPU interpreter, whose bf16 `tl.dot` is wrong (Triton 3.9).

    Kernels take a `DOT_IN_FP32` constexpr from this: the interpreter then multiplies fp32
    copies of the bf16 tiles (products of bf16 values are exact in fp32), while compiled
    kernels keep the native bf16 tensor-core dot.
    """
    return os.environ.get("TRITON_INTERPRET") == "1"
