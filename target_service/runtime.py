"""The loaded target as the servicer sees it: sessions, facts, counters, feature export."""

from __future__ import annotations

import logging
import time

import torch

from dflash_serve.errors import InvalidRequestError
from dflash_serve.feature_channel import encode_inline
from dflash_serve.feature_refs import InlineFeatures, SharedBufferInfo, SharedFeatures
from dflash_serve.kernels import fast_path_startup
from dflash_serve.service_info import TargetInfo
from dflash_serve.speculative.types import TargetStep
from target_service.config import TargetServiceConfig
from target_service.engine import TargetEngine
from target_service.model.loader import load_target_model
from target_service.model.state import StateShape
from target_service.session import InProcessTarget

logger = logging.getLogger(__name__)


class TargetRuntime:
    """Loads the model (blocking; call from a worker thread) and serves sessions."""

    def __init__(self, config: TargetServiceConfig) -> None:
        service = config.service
        service.apply_memory_cap()
        model = load_target_model(
            config.model, getattr(torch, service.resolved_dtype), service.device, True
        )
        shape = StateShape(service.max_sessions, service.max_context_tokens)
        is_fast = service.uses_gpu_fast_path()
        graph_batch_sizes = tuple(range(1, service.max_batch_size + 1)) if is_fast else ()
        with fast_path_startup(is_fast):
            if is_fast:
                model.use_gpu_kernels(
                    service.max_batch_size * shape.max_block_tokens,
                    config.int4_reads,
                    config.prefill_int4_reads,
                )
            self.engine = TargetEngine(
                model,
                shape,
                config.tap_layer_ids,
                config.prefill_chunk_tokens,
                share_features=service.device.startswith("cuda"),
                graph_batch_sizes=graph_batch_sizes,
                prefill_run_tokens=config.prefill_graph_tokens if is_fast else (),
                prefill_batch_rows=config.prefill_batch_rows if is_fast else None,
                commit_graphs=config.commit_graphs,  # ignored without verify graphs
            )
            if is_fast:
                began = time.perf_counter()
                self.engine.warm_up(service.max_batch_size)
                logger.info("kernels warmed up in %.1f s", time.perf_counter() - began)
        self.target = InProcessTarget(
            self.engine,
            service.max_batch_size,
            service.wait_us("target"),
            service.engine_threads,
            inline_batches=is_fast,
            max_gap_us=service.max_gap_us,
        )
        model_config = model.config
        self.info = TargetInfo(
            model_name=config.model,
            vocab_size=model_config.vocab_size,
            eos_token_ids=model_config.eos_token_ids,
            max_context_tokens=service.max_context_tokens,
            tap_layer_ids=tuple(config.tap_layer_ids),
            max_block_tokens=shape.max_block_tokens,
            hidden_size=model_config.hidden_size,
            device=str(self.engine.device),
            max_sessions=service.max_sessions,
        )

    def shared_buffer(self) -> SharedBufferInfo | None:
        shared = self.engine.shared_features
        return None if shared is None else shared.export()

    def check_transport(self, transport: str) -> None:
        if transport != "none" and not self.info.tap_layer_ids:
            raise InvalidRequestError(
                "this target was started without tap layers, so it returns no features; "
                "open with feature transport 'none' or restart it with --tap-layer-ids"
            )
        if transport == "cuda_ipc" and self.engine.shared_features is None:
            raise InvalidRequestError("cuda_ipc features need a target running on a GPU")

    def export_features(
        self, step: TargetStep, slot: int, transport: str
    ) -> InlineFeatures | SharedFeatures | None:
        if transport == "none" or step.features is None:
            return None
        if transport == "inline":
            return encode_inline(step.features)
        num_tokens, row_width = step.features.shape
        buffer_id = self.engine.shared_features.buffer_id
        return SharedFeatures(buffer_id, slot, step.start_position, num_tokens, row_width)

    def stats(self) -> dict[str, int]:
        """The batcher's counters: its requests are verify blocks and shared prompts alike."""
        counters = self.target.batcher.counters
        return {
            "num_active_sessions": self.engine.slots.num_active,
            "num_verify_batches": counters.num_batches,
            "num_verify_steps": counters.num_requests,
            "max_verify_batch_size": counters.max_batch_size_seen,
            "verify_wait_us": counters.total_wait_us,
            "num_inline_verify_batches": counters.num_inline_batches,
        }

    def close(self) -> None:
        self.target.close()
