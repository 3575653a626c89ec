"""The Qwen3.5 text-model configuration, read from a Hugging Face `config.json`.

Both services need it: the target builds its model from it, the drafter checks that it fits
the target (hidden size, number of layers for the tap ids, vocabulary for the mask id).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dflash_serve.errors import CheckpointError, ConfigError

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"
SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
# Tensor-name prefixes of the text model in the two published layouts.
MULTIMODAL_TEXT_PREFIX = "model.language_model."
TEXT_ONLY_PREFIX = "model."


@dataclass(frozen=True)
class Qwen35TextConfig:
    """Shapes and constants of the Qwen3.5 text model (hybrid GDN + gated attention)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    tensor_prefix: str
    quantization: dict[str, Any] | None = None

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def gdn_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def gdn_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def gdn_conv_dim(self) -> int:
        """Channels of the depthwise conv: q | k | v, before the split."""
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Qwen35TextConfig:
        """Build from a parsed config.json of either layout; raise ConfigError naming bad fields."""
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"config.json: model_type is {model_type!r}; this engine serves Qwen3.5 "
                f"checkpoints only (model_type one of {SUPPORTED_MODEL_TYPES})"
            )
        nested = "text_config" in raw
        text = raw["text_config"] if nested else raw
        if not isinstance(text, dict):
            raise ConfigError("config.json: text_config must be an object")
        prefix = MULTIMODAL_TEXT_PREFIX if nested else TEXT_ONLY_PREFIX
        return cls._from_text_fields(text, raw, prefix)

    @classmethod
    def _from_text_fields(cls, text: dict, raw: dict, prefix: str) -> Qwen35TextConfig:
        def need(name: str) -> Any:
            if name not in text:
                raise ConfigError(f"config.json: required field {name!r} is missing")
            return text[name]

        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        rope_theta = rope.get("rope_theta", text.get("rope_theta", 10_000_000.0))
        partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0))
        num_layers = int(need("num_hidden_layers"))
        interval = int(text.get("full_attention_interval", 4))
        layer_types = text.get("layer_types") or [
            FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION
            for i in range(num_layers)
        ]
        # A quantization_config may sit at the top level (VLM) or next to the text fields.
        quantization = raw.get("quantization_config") or text.get("quantization_config")
        tie = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        config = cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("hidden_size")),
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=num_layers,
            layer_types=tuple(layer_types),
            num_attention_heads=int(need("num_attention_heads")),
            num_key_value_heads=int(need("num_key_value_heads")),
            head_dim=int(text.get("head_dim", 256)),
            linear_num_key_heads=int(need("linear_num_key_heads")),
            linear_num_value_heads=int(need("linear_num_value_heads")),
            linear_key_head_dim=int(need("linear_key_head_dim")),
            linear_value_head_dim=int(need("linear_value_head_dim")),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            partial_rotary_factor=float(partial),
            max_position_embeddings=int(text.get("max_position_embeddings", 262_144)),
            tie_word_embeddings=bool(tie),
            eos_token_ids=_as_id_tuple(text.get("eos_token_id", raw.get("eos_token_id"))),
            tensor_prefix=prefix,
            quantization=quantization,
        )
        config.validate()
        return config

    def validate(self) -> None:
        """Check the internal consistency the model code relies on."""
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"config.json: layer_types has {len(self.layer_types)} entries, "
                f"num_hidden_layers is {self.num_hidden_layers}"
            )
        unknown = sorted(set(self.layer_types) - {FULL_ATTENTION, LINEAR_ATTENTION})
        if unknown:
            raise ConfigError(f"config.json: unknown layer_types {unknown}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"config.json: num_attention_heads {self.num_attention_heads} is not a "
                f"multiple of num_key_value_heads {self.num_key_value_heads}"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(
                f"config.json: linear_num_value_heads {self.linear_num_value_heads} is not a "
                f"multiple of linear_num_key_heads {self.linear_num_key_heads}"
            )
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ConfigError(
                f"config.json: partial_rotary_factor {self.partial_rotary_factor} gives "
                f"{self.rotary_dim} rotary dims of head_dim {self.head_dim}; need an even "
                "number in 1..head_dim"
            )


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def read_config_json(model_dir: Path) -> dict[str, Any]:
    """Parse `model_dir/config.json`, with an error that says which file is wrong."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir}: no config.json; is this a model directory?")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{path}: not valid JSON ({error})") from error


def load_qwen35_config(model_dir: Path) -> Qwen35TextConfig:
    """Read and validate the text config of a Qwen3.5 checkpoint directory."""
    raw = read_config_json(model_dir)
    config = Qwen35TextConfig.from_dict(raw)
    generation = Path(model_dir) / "generation_config.json"
    if generation.is_file() and not config.eos_token_ids:
        eos = _as_id_tuple(json.loads(generation.read_text()).get("eos_token_id"))
        config = replace(config, eos_token_ids=eos)
    return config
