"""The gateway's connection to the target service: facts, stats and session streams.

Implements dflash_serve.speculative.protocols.TargetSession over one bidirectional stream
per request; protobuf stops here.
"""

from __future__ import annotations

import grpc

from dflash_protos import target_pb2, target_pb2_grpc
from dflash_serve import step_trace
from dflash_serve.feature_refs import SharedBufferInfo
from dflash_serve.grpc_support.feature_messages import (
    TRANSPORTS,
    features_from_message,
    shared_buffer_from_message,
)
from dflash_serve.grpc_support.server import CHANNEL_OPTIONS
from dflash_serve.service_info import TargetInfo
from dflash_serve.speculative.types import SamplingParams, TargetStep
from gateway.session_calls import SessionCalls, read_event, write_request


class TargetClient:
    def __init__(
        self,
        address: str,
        rpc_timeout_s: float = 10.0,
        session_transport: str = "auto",
        session_spin_us: int | None = None,
    ) -> None:
        """`session_transport`: "auto" opens sessions on the service's local session socket
        once `info()` has found one on this host; "grpc" always on gRPC. `session_spin_us`:
        see SessionCalls."""
        self.address = address
        self.rpc_timeout_s = rpc_timeout_s
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = target_pb2_grpc.TargetServiceStub(self.channel)
        self.sessions = SessionCalls(
            self.stub.RunSession,
            target_pb2.RunSessionResponse,
            session_transport,
            session_spin_us,
            refresh=self.info,
        )

    async def info(self) -> TargetInfo:
        r = await self.stub.GetInfo(target_pb2.GetInfoRequest(), timeout=self.rpc_timeout_s)
        self.sessions.use_socket_if_local(r.session_socket, r.session_spin_us)
        return TargetInfo(
            r.model_name,
            r.vocab_size,
            tuple(r.eos_token_ids),
            r.max_context_tokens,
            tuple(r.tap_layer_ids),
            r.max_block_tokens,
            r.hidden_size,
            r.device,
            r.max_sessions,
        )

    async def stats(self) -> dict[str, int]:
        r = await self.stub.GetStats(target_pb2.GetStatsRequest(), timeout=self.rpc_timeout_s)
        return {name: getattr(r, name) for name in r.DESCRIPTOR.fields_by_name}

    async def feature_buffer(self) -> SharedBufferInfo:
        request = target_pb2.GetFeatureBufferRequest()
        response = await self.stub.GetFeatureBuffer(request, timeout=self.rpc_timeout_s)
        return shared_buffer_from_message(response.buffer)

    async def open(
        self, sampling: SamplingParams, transport: str, timeout_s: float | None = None
    ) -> RemoteTargetSession:
        """Open a session stream; `timeout_s` is the deadline of the whole request."""
        open_message = target_pb2.OpenSession(
            sampling=target_pb2.SamplingParams(
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                seed=sampling.seed,
            ),
            feature_transport=TRANSPORTS[transport],
        )
        request = target_pb2.RunSessionRequest(open=open_message)
        return RemoteTargetSession(*await self.sessions.start(request, timeout_s))

    async def close(self) -> None:
        await self.channel.close()


class RemoteTargetSession:
    """One request's target session over a stream."""

    def __init__(self, call, slot: int) -> None:
        self.call = call
        self.slot = slot

    async def prefill(self, prompt_ids: list[int]) -> TargetStep:
        request = target_pb2.RunSessionRequest(prefill=target_pb2.Prefill(prompt_ids=prompt_ids))
        return await self._step(request, "prefill")

    async def verify(self, block_ids: list[int]) -> TargetStep:
        request = target_pb2.RunSessionRequest(verify=target_pb2.Verify(block_ids=block_ids))
        return await self._step(request, "verify")

    async def _step(self, request, kind: str) -> TargetStep:
        step_trace.mark(f"gateway.{kind}.send")
        await write_request(self.call, request)
        step_trace.mark(f"gateway.{kind}.sent")
        result = await read_event(self.call, "step")
        step_trace.mark(f"gateway.{kind}.received")
        features = None
        if result.HasField("features"):
            ref = result.features
            count = ref.inline.num_chunks if ref.WhichOneof("location") == "inline" else 0
            chunks = [await read_event(self.call, "feature_chunk") for _ in range(count)]
            features = features_from_message(ref, chunks)
        return TargetStep(
            token_ids=list(result.token_ids),
            num_accepted=result.num_accepted,
            features=features,
            forward_ns=result.forward_ns,
            batch_size=result.batch_size,
        )

    async def close(self) -> None:
        """Cancelling the stream frees the session on the server at once."""
        self.call.cancel()
