"""The target service's one frozen config, built by the launcher from flags."""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash_serve.errors import ConfigError
from dflash_serve.layers.int4_reads import INT4_READS
from dflash_serve.service_settings import ServiceSettings

# Each prefill chunk is one eager forward: ~2,000 host-bound kernel launches (~60 ms on an
# H200), about the GPU time of 2,048 tokens; smaller chunks multiplied that cost (measured
# with bench.prefill --profile).
DEFAULT_PREFILL_CHUNK_TOKENS = 2048


@dataclass(frozen=True)
class TargetServiceConfig:
    model: str
    tap_layer_ids: tuple[int, ...] = ()
    prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS
    int4_reads: str = INT4_READS[0]  # what the GPU kernels read for 4-bit layers
    service: ServiceSettings = field(default_factory=ServiceSettings)

    def validate(self) -> None:
        self.service.validate("target")
        if self.prefill_chunk_tokens < 1:
            raise ConfigError(f"prefill_chunk_tokens must be >= 1, got {self.prefill_chunk_tokens}")
        if self.int4_reads not in INT4_READS:
            raise ConfigError(f"int4_reads must be one of {INT4_READS}, got {self.int4_reads!r}")
