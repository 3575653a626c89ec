"""The target's gRPC servicer and its `serve` entry point (protobuf stops here)."""

from __future__ import annotations

import logging

import grpc

from dflash_protos import target_pb2, target_pb2_grpc
from dflash_serve import step_trace
from dflash_serve.errors import DflashError, InvalidRequestError
from dflash_serve.grpc_support.errors import abort_with
from dflash_serve.grpc_support.feature_messages import (
    chunk_messages,
    feature_ref_message,
    shared_buffer_message,
    transport_name,
)
from dflash_serve.grpc_support.model_servicer import ModelServicer, serve_model
from dflash_serve.speculative.types import SamplingParams, TargetStep
from target_service.config import TargetServiceConfig
from target_service.runtime import TargetRuntime

logger = logging.getLogger(__name__)

SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name


class TargetServicer(ModelServicer, target_pb2_grpc.TargetServiceServicer):
    kind = "target"

    async def GetInfo(self, request, context):
        return await self.answer(context, target_pb2.GetInfoResponse, self.info_fields)

    async def GetStats(self, request, context):
        return await self.answer(context, target_pb2.GetStatsResponse, lambda r: r.stats())

    async def GetFeatureBuffer(self, request, context):
        try:
            info = self.ready().shared_buffer()
        except DflashError as error:
            await abort_with(context, error)
        if info is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this target has no shared CUDA feature buffer (it runs on the CPU or has "
                "no tap layers); use inline features",
            )
        return target_pb2.GetFeatureBufferResponse(buffer=shared_buffer_message(info))

    async def session_responses(self, requests, on_open):
        """ModelServicer.session_responses; raises DflashError for a request it refuses
        (after closing the session)."""
        session, transport = None, "none"
        try:
            async for message in requests:
                kind = message.WhichOneof("step")
                if kind == "open":
                    if session is not None:
                        raise InvalidRequestError("open was sent twice on one session stream")
                    session, transport = await self._open(message.open)
                    on_open(session)
                    yield target_pb2.RunSessionResponse(
                        opened=target_pb2.SessionOpened(slot=session.slot)
                    )
                    continue
                if session is None:
                    raise InvalidRequestError(f"{kind} before open: open the session first")
                if kind == "prefill":
                    step = await session.prefill(list(message.prefill.prompt_ids))
                elif kind == "verify":
                    step_trace.mark("target.received")
                    step = await session.verify(list(message.verify.block_ids))
                    step_trace.mark("target.result")
                else:
                    raise InvalidRequestError(
                        "empty RunSessionRequest: set open, prefill or verify"
                    )
                for response in self._step_messages(step, session.slot, transport):
                    yield response
        finally:
            if session is not None:
                await session.close()

    async def _open(self, open_message):
        runtime = self.ready()
        transport = transport_name(open_message.feature_transport, default="none")
        runtime.check_transport(transport)
        sampling = open_message.sampling
        params = SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p or 1.0,
            top_k=sampling.top_k,
            seed=sampling.seed,
        )
        return await runtime.target.open(params), transport

    def _step_messages(self, step: TargetStep, slot: int, transport: str):
        features = self.runtime.export_features(step, slot, transport)
        result = target_pb2.StepResult(
            token_ids=step.token_ids,
            num_accepted=step.num_accepted,
            forward_ns=step.forward_ns,
            batch_size=step.batch_size,
        )
        if features is not None:
            result.features.CopyFrom(feature_ref_message(features))
        step_trace.mark("target.respond")
        yield target_pb2.RunSessionResponse(step=result)
        if features is not None:
            for chunk in chunk_messages(features):
                yield target_pb2.RunSessionResponse(feature_chunk=chunk)


async def serve(config: TargetServiceConfig) -> None:
    """Run the target service until SIGTERM (health NOT_SERVING while loading)."""
    await serve_model(
        TargetServicer(),
        SERVICE_NAME,
        target_pb2_grpc.add_TargetServiceServicer_to_server,
        target_pb2.RunSessionRequest,
        config.service,
        lambda: TargetRuntime(config),
        config.model,
    )
