"""The gateway's connection to the drafter service (DrafterSession over a stream)."""

from __future__ import annotations

import grpc

from dflash_protos import drafter_pb2, drafter_pb2_grpc
from dflash_serve import step_trace
from dflash_serve.feature_refs import SharedBufferInfo
from dflash_serve.grpc_support.feature_messages import (
    TRANSPORTS,
    chunk_messages,
    feature_ref_message,
    shared_buffer_message,
)
from dflash_serve.grpc_support.server import CHANNEL_OPTIONS
from dflash_serve.service_info import DrafterInfo
from gateway.session_calls import SessionCalls, read_event, write_request


class DrafterClient:
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
        self.stub = drafter_pb2_grpc.DrafterServiceStub(self.channel)
        self.sessions = SessionCalls(
            self.stub.RunSession,
            drafter_pb2.RunSessionResponse,
            session_transport,
            session_spin_us,
            refresh=self.info,
        )

    async def info(self) -> DrafterInfo:
        r = await self.stub.GetInfo(drafter_pb2.GetInfoRequest(), timeout=self.rpc_timeout_s)
        self.sessions.use_socket_if_local(r.session_socket, r.session_spin_us)
        return DrafterInfo(
            r.model_name,
            r.target_model_name,
            tuple(r.tap_layer_ids),
            r.block_size,
            r.max_drafts,
            r.mask_token_id,
            r.hidden_size,
            r.device,
            r.max_sessions,
            r.max_context_tokens,
        )

    async def stats(self) -> dict[str, int]:
        r = await self.stub.GetStats(drafter_pb2.GetStatsRequest(), timeout=self.rpc_timeout_s)
        return {name: getattr(r, name) for name in r.DESCRIPTOR.fields_by_name}

    async def open(
        self,
        transport: str,
        shared_buffer: SharedBufferInfo | None = None,
        timeout_s: float | None = None,
    ) -> RemoteDrafterSession:
        open_message = drafter_pb2.OpenSession(feature_transport=TRANSPORTS[transport])
        if shared_buffer is not None:
            open_message.shared_buffer.CopyFrom(shared_buffer_message(shared_buffer))
        request = drafter_pb2.RunSessionRequest(open=open_message)
        return RemoteDrafterSession(*await self.sessions.start(request, timeout_s))

    async def close(self) -> None:
        await self.channel.close()


class RemoteDrafterSession:
    def __init__(self, call, slot: int) -> None:
        self.call = call
        self.slot = slot
        self.last_forward_ns = 0
        self.last_batch_size = 0

    async def draft(self, features, anchor_id: int, num_drafts: int) -> list[int]:
        """`features`: the InlineFeatures/SharedFeatures the target returned, passed through."""
        step_trace.mark("gateway.draft.send")
        draft = drafter_pb2.Draft(
            features=feature_ref_message(features), anchor_id=anchor_id, num_drafts=num_drafts
        )
        await write_request(self.call, drafter_pb2.RunSessionRequest(draft=draft))
        for chunk in chunk_messages(features):
            await write_request(self.call, drafter_pb2.RunSessionRequest(feature_chunk=chunk))
        step_trace.mark("gateway.draft.sent")
        drafted = await read_event(self.call, "drafted")
        step_trace.mark("gateway.draft.received")
        self.last_forward_ns, self.last_batch_size = drafted.forward_ns, drafted.batch_size
        return list(drafted.draft_ids)

    async def close(self) -> None:
        self.call.cancel()
