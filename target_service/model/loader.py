"""Build the target model from a Hugging Face checkpoint directory (bf16/fp16/fp32 or 4-bit).

Module attribute names equal checkpoint tensor names after the text prefix, so loading is a
walk over the model's own parameters. Linear layers are dense or 4-bit according to the
tensors actually present (a mixed checkpoint loads). Tensors the text model does not use
(vision tower, MTP head) are never read.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from dflash_serve.checkpoint.int4_formats import detect_linear_format, read_int4_weight
from dflash_serve.checkpoint.resolve import resolve_model_dir
from dflash_serve.checkpoint.safetensors_reader import TensorReader
from dflash_serve.errors import CheckpointError
from dflash_serve.layers.linear import Int4Linear, Linear
from dflash_serve.layers.rotary import RotaryEmbedding
from dflash_serve.qwen35_config import Qwen35TextConfig, load_qwen35_config
from target_service.model.decoder import Qwen35TextModel

logger = logging.getLogger(__name__)

# GDN decay parameters stay fp32 whatever the compute dtype (as the reference does).
FP32_PARAMETERS = ("A_log", "dt_bias")
UNTIED_HEAD_NAME = "lm_head.weight"


def load_target_model(
    path_or_id: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    show_progress: bool = False,
) -> Qwen35TextModel:
    """Load a Qwen3.5 text model; errors name the file or tensor at fault."""
    model_dir = resolve_model_dir(path_or_id)
    config = load_qwen35_config(model_dir)
    reader = TensorReader(model_dir)
    with torch.device("meta"):
        model = Qwen35TextModel(config)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, Linear)]
    others = [
        (n, p)
        for n, p in model.named_parameters()
        if not isinstance(model.get_submodule(n.rpartition(".")[0]), Linear)
    ]
    steps = tqdm(
        total=len(linears) + len(others),
        desc=f"loading {model_dir.name}",
        disable=not show_progress,
        unit="tensor",
    )
    for name, module in linears:
        _load_linear(model, name, module, reader, config, dtype, device)
        steps.update()
    for name, param in others:
        target_dtype = torch.float32 if name.rpartition(".")[2] in FP32_PARAMETERS else dtype
        tensor = _read_checked(reader, config.tensor_prefix + name, tuple(param.shape))
        _set_parameter(model, name, tensor.to(device=device, dtype=target_dtype))
        steps.update()
    steps.close()
    if not config.tie_word_embeddings:
        model.lm_head = _load_untied_head(reader, config, dtype, device)
    model.rotary = RotaryEmbedding(config.rotary_dim, config.rope_theta).to(device)
    logger.info("loaded %s: %d layers, %s", model_dir, config.num_hidden_layers, dtype)
    return model.eval()


def _load_linear(model, name, module: Linear, reader, config, dtype, device) -> None:
    prefix = f"{config.tensor_prefix}{name}."
    fmt = detect_linear_format(reader, prefix)
    if fmt == "dense":
        weight = _read_checked(reader, prefix + "weight", (module.out_features, module.in_features))
        _set_parameter(model, name + ".weight", weight.to(device=device, dtype=dtype))
        return
    packed = read_int4_weight(
        reader, prefix, fmt, config.quantization, module.out_features, module.in_features
    )
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, Int4Linear(packed, dtype).to(device))


def _read_checked(reader: TensorReader, name: str, expected: tuple[int, ...]) -> torch.Tensor:
    actual = reader.shape(name)
    if actual != expected:
        raise CheckpointError(
            f"{reader.model_dir}: tensor {name!r} has shape {list(actual)}, the config "
            f"implies {list(expected)}; config.json and the weights disagree"
        )
    return reader.read(name)


def _set_parameter(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    setattr(parent, attr, nn.Parameter(tensor, requires_grad=False))


def _load_untied_head(reader, config: Qwen35TextConfig, dtype, device) -> nn.Module:
    head = nn.Module()
    expected = (config.vocab_size, config.hidden_size)
    weight = _read_checked(reader, UNTIED_HEAD_NAME, expected).to(device=device, dtype=dtype)
    head.weight = nn.Parameter(weight, requires_grad=False)
    return head
