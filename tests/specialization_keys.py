"""The key under which Triton caches a kernel's compiled variant, for the launches a call makes.

Triton compiles one variant per key: constexprs, dtypes, and for every other argument not
listed in `do_not_specialize` whether it is 1 or a multiple of 16 (ints) or 16-byte aligned
(pointers, unless in `do_not_specialize_on_alignment`). A serving path whose key changes
with the batch (row counts, index views at odd offsets) compiles in the middle of a request.
Computed with Triton's own specialization function, so it runs on the CPU (interpreter).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from triton.backends import BaseBackend
from triton.runtime.jit import native_specialize_impl


def launch_keys(kernel, call: Callable[[], object]) -> list[tuple]:
    """The specialization key of every launch of `kernel` while `call()` runs."""
    launches = []

    def record(*args, **kwargs):
        launches.append((args, kwargs))

    kernel.add_pre_run_hook(record)
    try:
        call()
    finally:
        kernel.pre_run_hooks.remove(record)
    parameters = inspect.signature(kernel.fn).parameters
    settings = getattr(kernel, "kwargs", None) or vars(kernel)  # interpreted, or compiled
    fixed_values = set(settings.get("do_not_specialize") or ())
    any_alignment = set(settings.get("do_not_specialize_on_alignment") or ())
    keys = []
    for args, kwargs in launches:
        bound = dict(zip(parameters, args, strict=False)) | {
            name: value for name, value in kwargs.items() if name in parameters
        }
        key = []
        for name, parameter in parameters.items():
            value = bound[name]
            if "constexpr" in str(parameter.annotation):
                key.append((name, "constexpr", value))
                continue
            specialize, align = name not in fixed_values, name not in any_alignment
            key.append(
                (name, *native_specialize_impl(BaseBackend, value, False, specialize, align))
            )
        keys.append(tuple(key))
    return keys
