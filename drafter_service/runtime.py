"""The loaded drafter as the servicer sees it: sessions, facts, counters, feature import."""

from __future__ import annotations

import torch

from dflash_serve.errors import InvalidRequestError
from dflash_serve.feature_channel import decode_inline, open_shared_buffer
from dflash_serve.feature_refs import InlineFeatures, SharedBufferInfo, SharedFeatures
from dflash_serve.kernels import fast_path_startup
from dflash_serve.service_info import DrafterInfo
from drafter_service.config import DrafterServiceConfig
from drafter_service.engine import DrafterEngine
from drafter_service.model.loader import load_drafter
from drafter_service.session import InProcessDrafter


class DrafterRuntime:
    """Loads the drafter (blocking; call from a worker thread) and serves sessions."""

    def __init__(self, config: DrafterServiceConfig) -> None:
        service = config.service
        service.apply_memory_cap()
        model = load_drafter(
            config.model,
            config.target_model,
            getattr(torch, service.drafter_dtype),
            service.device,
            show_progress=True,
        )
        is_fast = service.uses_gpu_fast_path()
        graph_batch_sizes = tuple(range(1, service.max_batch_size + 1)) if is_fast else ()
        with fast_path_startup(is_fast):
            if is_fast:
                model.use_gpu_kernels()
            self.engine = DrafterEngine(
                model, service.max_sessions, service.max_context_tokens, graph_batch_sizes
            )
        self.drafter = InProcessDrafter(
            self.engine,
            service.max_batch_size,
            service.wait_us("drafter"),
            service.engine_threads,
            inline_batches=is_fast,
            max_gap_us=service.max_gap_us,
        )
        dflash = model.config
        self.info = DrafterInfo(
            model_name=config.model,
            target_model_name=config.target_model,
            tap_layer_ids=dflash.target_layer_ids,
            block_size=dflash.block_size,
            max_drafts=dflash.max_drafts,
            mask_token_id=dflash.mask_token_id,
            hidden_size=dflash.hidden_size,
            device=str(self.engine.device),
            max_sessions=service.max_sessions,
            max_context_tokens=service.max_context_tokens,
        )
        self._shared_buffers: dict[str, torch.Tensor] = {}

    def attach_shared_buffer(self, info: SharedBufferInfo) -> None:
        """Map a target's CUDA buffer once per buffer id."""
        if self.engine.device.type != "cuda":
            raise InvalidRequestError("cuda_ipc features need a drafter running on a GPU")
        if info.buffer_id not in self._shared_buffers:
            self._shared_buffers[info.buffer_id] = open_shared_buffer(info)

    def import_features(self, features: InlineFeatures | SharedFeatures) -> torch.Tensor:
        if isinstance(features, InlineFeatures):
            return decode_inline(features, self.engine.device)
        buffer = self._shared_buffers.get(features.buffer_id)
        if buffer is None:
            raise InvalidRequestError(
                f"shared feature buffer {features.buffer_id!r} was not attached at open"
            )
        start = features.start_position
        return buffer[features.slot, start : start + features.num_tokens]

    def stats(self) -> dict[str, int]:
        counters = self.drafter.batcher.counters
        return {
            "num_active_sessions": self.engine.slots.num_active,
            "num_draft_batches": counters.num_batches,
            "num_draft_steps": counters.num_requests,
            "max_draft_batch_size": counters.max_batch_size_seen,
            "draft_wait_us": counters.total_wait_us,
            "num_inline_draft_batches": counters.num_inline_batches,
        }

    def close(self) -> None:
        self.drafter.close()
