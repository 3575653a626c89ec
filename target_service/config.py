"""The target service's one frozen config, built by the launcher from flags."""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash_serve.errors import ConfigError
from dflash_serve.service_settings import ServiceSettings


@dataclass(frozen=True)
class TargetServiceConfig:
    model: str
    tap_layer_ids: tuple[int, ...] = ()
    prefill_chunk_tokens: int = 512
    service: ServiceSettings = field(default_factory=ServiceSettings)

    def validate(self) -> None:
        self.service.validate("target")
        if self.prefill_chunk_tokens < 1:
            raise ConfigError(f"prefill_chunk_tokens must be >= 1, got {self.prefill_chunk_tokens}")
