"""The target service's one frozen config, built by the launcher from flags."""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash_serve.errors import ConfigError
from dflash_serve.layers.int4_reads import (
    INT4_READS,
    PREFILL_INT4_READS_DEFAULT,
    check_int4_reads,
)
from dflash_serve.service_settings import ServiceSettings

# Each prefill chunk is one eager forward with a fixed host cost on a GPU (~55 ms on an H200
# when this was measured, ~1,800 launches; ~925 since), while its GPU time grows with it
# (2,048 tokens ~45 ms). Chunks of 2,048 kept the GPU waiting for the host; of 8,192 an
# 8,192-token prompt of the 4B-shaped target took 177 ms instead of 214 ms (4,096: 188 ms),
# for ~1.3 GB of activations instead of ~0.35 GB (H200, same-process A/B; README "GPU fast
# path"). On a CPU a smaller chunk bounds activation memory for long prompts.
DEFAULT_PREFILL_CHUNK_TOKENS = 8192
# Prompts up to 2,048 tokens are prefilled from CUDA graphs of these lengths, padded to the
# next one (target_service/prefill_graphs.py): at most twice the prompt below 512 tokens,
# where reading the weights rather than the padding's work sets the time; 1.5× above.
DEFAULT_PREFILL_GRAPH_TOKENS = (32, 64, 128, 256, 512, 768, 1024, 1536, 2048)
# Prompts of sessions that start together share a padded prefill forward of up to this many
# rows (prompts × run length) on the GPU fast path, if their run length is one the
# row-independent kernels take alone (up to the largest verify batch, 16 × 16 by default):
# the forward runs on those kernels, from 512 rows on through their wide launch. On an H100
# (int4 all, 2026-12-05) 8 prompts of 128 tokens took 40.5 ms in one 1024-row forward against
# 50.2 ms in four of 256 rows (bench/results/prefill-wide-launch-2026-12-05-nvidia-h100.json).
DEFAULT_PREFILL_BATCH_ROWS = 1024


@dataclass(frozen=True)
class TargetServiceConfig:
    model: str
    tap_layer_ids: tuple[int, ...] = ()
    prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS
    prefill_graph_tokens: tuple[int, ...] = DEFAULT_PREFILL_GRAPH_TOKENS  # GPU fast path only
    int4_reads: str = INT4_READS[0]  # what the GPU kernels read for 4-bit layers
    prefill_int4_reads: str = PREFILL_INT4_READS_DEFAULT  # the same, on prefill forwards
    prefill_batch_rows: int = DEFAULT_PREFILL_BATCH_ROWS  # GPU fast path only
    commit_graphs: bool = True  # GPU fast path only: commits replayed from CUDA graphs
    service: ServiceSettings = field(default_factory=ServiceSettings)

    def validate(self) -> None:
        self.service.validate("target")
        if self.prefill_chunk_tokens < 1:
            raise ConfigError(f"prefill_chunk_tokens must be >= 1, got {self.prefill_chunk_tokens}")
        if any(tokens < 1 for tokens in self.prefill_graph_tokens):
            raise ConfigError(
                f"prefill_graph_tokens must all be >= 1, got {self.prefill_graph_tokens}"
            )
        if self.prefill_batch_rows < 1:
            raise ConfigError(f"prefill_batch_rows must be >= 1, got {self.prefill_batch_rows}")
        try:
            check_int4_reads(self.int4_reads, self.prefill_int4_reads)
        except ValueError as error:
            raise ConfigError(str(error)) from error
