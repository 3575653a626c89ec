"""Triton kernels shared by the target and the drafter, each beside its plain-torch reference.

Triton is a GPU dependency: nothing here is imported on the plain-torch (CPU) path. The tests
also run the kernels on CPU through Triton's interpreter (`TRITON_INTERPRET=1`).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Iterator
from contextlib import contextmanager

from dflash_serve.errors import ConfigError, DflashError

# Whether the GPU compiler may contract a * b + c into one FMA. On (Triton's default up to 3.9,
# under which the kernels were measured and their GPU tests pass) for every kernel that does
# not turn it off itself; pinned because Triton 3.10 changes the default.
FP_FUSION = True


def is_triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def is_interpreting() -> bool:
    """True under Triton's CPU interpreter, whose bf16 `tl.dot` is wrong (Triton 3.9).

    Kernels take a `DOT_IN_FP32` constexpr from this: the interpreter then multiplies fp32
    copies of the bf16 tiles (products of bf16 values are exact in fp32), while compiled
    kernels keep the native bf16 tensor-core dot.
    """
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def programmatic_launch() -> bool:
    """Whether kernels are launched with programmatic dependent launch (PDL, Hopper and newer).

    A verify step is ~500 short kernels; with PDL the next kernel's programs are scheduled
    while the current one drains, instead of after it, and each waits in `wait_for_inputs`
    before touching memory. The arithmetic is unchanged, so outputs are bit-identical either
    way. DFLASH_PDL=0 turns it off (to measure what it saves); the interpreter ignores it."""
    if os.environ.get("DFLASH_PDL", "1") == "0":
        return False
    return is_hopper_or_newer()


def is_hopper_or_newer(device_index: int | None = None) -> bool:
    """Whether a CUDA device (the current one for None) is Hopper or newer (compute
    capability 9+): what programmatic dependent launch and TMA loads need."""
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability(device_index)[0] >= 9


def launch_options(fp_fusion: bool = FP_FUSION) -> dict[str, bool]:
    """The compile/launch options every kernel launch passes: FMA contraction (`FP_FUSION`
    unless the kernel turns it off) and programmatic dependent launch."""
    return {"enable_fp_fusion": fp_fusion, "launch_pdl": programmatic_launch()}


@contextmanager
def fast_path_startup(is_enabled: bool) -> Iterator[None]:
    """Name the way out when compiling kernels or capturing graphs fails at start-up
    (an unsupported GPU or model shape): the plain-torch path still serves."""
    try:
        yield
    except DflashError:
        raise
    except Exception as error:
        if not is_enabled:
            raise
        raise ConfigError(
            f"the GPU fast path failed to start ({type(error).__name__}: {error}); "
            "start the services with --no-gpu-fast-path to serve on the plain-torch path"
        ) from error
