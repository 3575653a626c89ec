"""The DFlash drafter configuration (z-lab `config.json` with a `dflash_config` block)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_serve.errors import ConfigError
from dflash_serve.qwen35_config import Qwen35TextConfig, read_config_json

SLIDING_ATTENTION = "sliding_attention"
FULL_ATTENTION = "full_attention"


@dataclass(frozen=True)
class DFlashConfig:
    """Shapes of the drafter and how it reads the target (tap layers, mask token, block)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    layer_types: tuple[str, ...]
    sliding_window: int | None
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    # None: the reference rule (sliding layers causal inside the block, full layers not).
    is_causal: bool | None
    input_embedding_scale: float
    output_multiplier: float
    final_logit_softcapping: float | None

    def layer_is_causal(self, layer_id: int) -> bool:
        if self.is_causal is not None:
            return self.is_causal
        return self.layer_types[layer_id] == SLIDING_ATTENTION

    def layer_window(self, layer_id: int) -> int | None:
        return self.sliding_window if self.layer_types[layer_id] == SLIDING_ATTENTION else None

    @property
    def max_drafts(self) -> int:
        return self.block_size - 1

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DFlashConfig:
        dflash = raw.get("dflash_config") or {}

        def pick(name: str, default: Any = None) -> Any:
            return dflash.get(name, raw.get(name, default))

        def need(name: str) -> Any:
            value = pick(name)
            if value is None:
                raise ConfigError(f"drafter config.json: required field {name!r} is missing")
            return value

        num_layers = int(need("num_hidden_layers"))
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        causal = pick("is_causal", dflash.get("causal"))
        heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        softcap = pick("final_logit_softcapping")
        config = cls(
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(pick("num_key_value_heads", heads)),
            head_dim=int(pick("head_dim") or hidden // heads),
            rms_norm_eps=float(pick("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 1_000_000.0))),
            layer_types=tuple(raw.get("layer_types") or [FULL_ATTENTION] * num_layers),
            sliding_window=raw.get("sliding_window"),
            block_size=int(pick("block_size", 16)),
            target_layer_ids=tuple(int(i) for i in need("target_layer_ids")),
            mask_token_id=int(need("mask_token_id")),
            is_causal=None if causal is None else bool(causal),
            input_embedding_scale=float(pick("input_embedding_scale", 1.0)),
            output_multiplier=float(pick("output_multiplier", 1.0)),
            final_logit_softcapping=None if softcap is None else float(softcap),
        )
        config.validate()
        return config

    def validate(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"drafter config.json: layer_types has {len(self.layer_types)} entries, "
                f"num_hidden_layers is {self.num_hidden_layers}"
            )
        unknown = sorted(set(self.layer_types) - {SLIDING_ATTENTION, FULL_ATTENTION})
        if unknown:
            raise ConfigError(f"drafter config.json: unknown layer_types {unknown}")
        if SLIDING_ATTENTION in self.layer_types and not self.sliding_window:
            raise ConfigError("drafter config.json: sliding layers need a sliding_window")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"drafter config.json: num_attention_heads {self.num_attention_heads} is not a "
                f"multiple of num_key_value_heads {self.num_key_value_heads}"
            )
        if not self.target_layer_ids:
            raise ConfigError("drafter config.json: target_layer_ids is empty")

    def check_fits(self, target: Qwen35TextConfig) -> None:
        """Raise ConfigError when this drafter cannot read this target."""
        if self.hidden_size != target.hidden_size:
            raise ConfigError(
                f"drafter hidden_size {self.hidden_size} differs from the target's "
                f"{target.hidden_size}; the drafter uses the target's embeddings and head"
            )
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_hidden_layers]
        if bad:
            raise ConfigError(
                f"drafter target_layer_ids {bad} out of range: the target has "
                f"{target.num_hidden_layers} layers (ids 0..{target.num_hidden_layers - 1})"
            )
        if not 0 <= self.mask_token_id < target.vocab_size:
            raise ConfigError(
                f"drafter mask_token_id {self.mask_token_id} is outside the target's "
                f"vocabulary 0..{target.vocab_size - 1}"
            )


def load_dflash_config(model_dir: Path) -> DFlashConfig:
    return DFlashConfig.from_dict(read_config_json(model_dir))
