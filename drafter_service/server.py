"""The drafter's gRPC servicer and its `serve` entry point (protobuf stops here)."""

from __future__ import annotations

import logging

from dflash_protos import drafter_pb2, drafter_pb2_grpc
from dflash_serve import step_trace
from dflash_serve.errors import InvalidRequestError
from dflash_serve.grpc_support.feature_messages import (
    features_from_message,
    shared_buffer_from_message,
    transport_name,
)
from dflash_serve.grpc_support.model_servicer import ModelServicer, serve_model
from drafter_service.config import DrafterServiceConfig
from drafter_service.runtime import DrafterRuntime

logger = logging.getLogger(__name__)

SERVICE_NAME = drafter_pb2.DESCRIPTOR.services_by_name["DrafterService"].full_name


class DrafterServicer(ModelServicer, drafter_pb2_grpc.DrafterServiceServicer):
    kind = "drafter"

    async def GetInfo(self, request, context):
        return await self.answer(context, drafter_pb2.GetInfoResponse, self.info_fields)

    async def GetStats(self, request, context):
        return await self.answer(context, drafter_pb2.GetStatsResponse, lambda r: r.stats())

    async def session_responses(self, requests, on_open):
        """ModelServicer.session_responses; raises DflashError for a request it refuses
        (after closing the session)."""
        session = None
        messages = aiter(requests)
        try:
            async for message in messages:
                kind = message.WhichOneof("step")
                if kind == "open":
                    if session is not None:
                        raise InvalidRequestError("open was sent twice on one session stream")
                    session = await self._open(message.open)
                    on_open(session)
                    yield drafter_pb2.RunSessionResponse(
                        opened=drafter_pb2.SessionOpened(slot=session.slot)
                    )
                elif session is None:
                    raise InvalidRequestError(f"{kind} before open: open the session first")
                elif kind == "draft":
                    step_trace.mark("drafter.received")
                    draft = message.draft
                    features = await self._features(draft.features, messages)
                    step_trace.mark("drafter.submit")
                    ids = await session.draft(features, draft.anchor_id, draft.num_drafts)
                    step_trace.mark("drafter.result")
                    yield drafter_pb2.RunSessionResponse(
                        drafted=drafter_pb2.Drafted(
                            draft_ids=ids,
                            forward_ns=session.last_forward_ns,
                            batch_size=session.last_batch_size,
                        )
                    )
                else:
                    raise InvalidRequestError(f"unexpected {kind or 'empty message'} here")
        finally:
            if session is not None:
                await session.close()

    async def _open(self, open_message):
        runtime = self.ready()
        transport = transport_name(open_message.feature_transport, default="inline")
        if transport == "none":
            raise InvalidRequestError("a drafter session needs features: inline or cuda_ipc")
        if transport == "cuda_ipc":
            runtime.attach_shared_buffer(shared_buffer_from_message(open_message.shared_buffer))
        return await runtime.drafter.open()

    async def _features(self, ref, messages):
        """Read the inline chunks that follow a draft, then rebuild the tensor."""
        chunks = []
        if ref.WhichOneof("location") == "inline":
            for _ in range(ref.inline.num_chunks):
                message = await anext(messages)
                if message.WhichOneof("step") != "feature_chunk":
                    raise InvalidRequestError("a draft's feature chunks were interrupted")
                chunks.append(message.feature_chunk)
        return self.runtime.import_features(features_from_message(ref, chunks))


async def serve(config: DrafterServiceConfig) -> None:
    """Run the drafter service until SIGTERM (health NOT_SERVING while loading)."""
    await serve_model(
        DrafterServicer(),
        SERVICE_NAME,
        drafter_pb2_grpc.add_DrafterServiceServicer_to_server,
        drafter_pb2.RunSessionRequest,
        config.service,
        lambda: DrafterRuntime(config),
        config.model,
    )
