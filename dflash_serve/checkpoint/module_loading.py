"""Fill a model built on the meta device with tensors from a checkpoint, by name.

Module attribute names equal checkpoint tensor names after a prefix, so loading is a walk
over the module's own parameters: every expected tensor must exist with the expected shape,
and tensors the module does not use are never read. Linear layers become dense or 4-bit
according to the tensors actually present, so mixed checkpoints load.
"""

from __future__ import annotations

import torch
from torch import nn
from tqdm import tqdm

from dflash_serve.checkpoint.int4_formats import detect_linear_format, read_int4_weight
from dflash_serve.checkpoint.safetensors_reader import TensorReader
from dflash_serve.errors import CheckpointError
from dflash_serve.layers.linear import Int4Linear, Linear


def load_module_weights(
    module: nn.Module,
    reader: TensorReader,
    prefix: str,
    dtype: torch.dtype,
    device: torch.device | str,
    quantization: dict | None = None,
    fp32_parameter_names: tuple[str, ...] = (),
    show_progress: bool = False,
) -> None:
    """Replace every meta parameter of `module` with `prefix + name` from the checkpoint."""
    linears = [(n, m) for n, m in module.named_modules() if isinstance(m, Linear)]
    linear_names = {n for n, _ in linears}
    others = [
        (n, p) for n, p in module.named_parameters() if n.rpartition(".")[0] not in linear_names
    ]
    progress = tqdm(
        total=len(linears) + len(others),
        desc=f"loading {reader.model_dir.name}",
        disable=not show_progress,
        unit="tensor",
    )
    for name, linear in linears:
        _load_linear(module, name, linear, reader, prefix, quantization, dtype, device)
        progress.update()
    for name, param in others:
        is_fp32 = name.rpartition(".")[2] in fp32_parameter_names
        tensor = read_checked(reader, prefix + name, tuple(param.shape))
        set_parameter(module, name, tensor.to(device, torch.float32 if is_fp32 else dtype))
        progress.update()
    progress.close()


def _load_linear(root, name, linear: Linear, reader, prefix, quantization, dtype, device):
    full_prefix = f"{prefix}{name}."
    fmt = detect_linear_format(reader, full_prefix)
    if fmt == "dense":
        expected = (linear.out_features, linear.in_features)
        weight = read_checked(reader, full_prefix + "weight", expected)
        set_parameter(root, name + ".weight", weight.to(device, dtype))
        return
    packed = read_int4_weight(
        reader, full_prefix, fmt, quantization, linear.out_features, linear.in_features
    )
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name), child, Int4Linear(packed, dtype).to(device))


def read_checked(reader: TensorReader, name: str, expected: tuple[int, ...]) -> torch.Tensor:
    """Read a tensor whose shape the config implies; a mismatch names both."""
    actual = reader.shape(name)
    if actual != expected:
        raise CheckpointError(
            f"{reader.model_dir}: tensor {name!r} has shape {list(actual)}, the config "
            f"implies {list(expected)}; config.json and the weights disagree"
        )
    return reader.read(name)


def set_parameter(root: nn.Module, name: str, tensor: torch.Tensor) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent_name), attr, nn.Parameter(tensor, requires_grad=False))
