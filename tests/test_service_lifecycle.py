"""Service lifecycle and the feature channel, with real gRPC servers inside the test process."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

import dflash_serve.feature_channel as feature_channel
from dflash_protos import target_pb2, target_pb2_grpc
from dflash_serve.errors import InvalidRequestError
from dflash_serve.feature_channel import decode_inline, encode_inline
from dflash_serve.grpc_support.server import GrpcServer
from dflash_serve.speculative.loop import SpeculativeGeneration, StopRules
from dflash_serve.speculative.types import SamplingParams
from drafter_service.config import DrafterServiceConfig
from drafter_service.runtime import DrafterRuntime
from drafter_service.server import SERVICE_NAME as DRAFTER_SERVICE
from drafter_service.server import DrafterServicer
from gateway.drafter_client import DrafterClient
from gateway.target_client import TargetClient
from target_service.config import TargetServiceConfig
from target_service.runtime import TargetRuntime
from target_service.server import SERVICE_NAME as TARGET_SERVICE
from target_service.server import TargetServicer


async def health_status(address: str, service: str = "") -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return response.status


def test_health_is_not_serving_while_loading_and_draining(causal_lm_dir):
    async def run():
        servicer = TargetServicer()
        server = GrpcServer(
            "127.0.0.1",
            0,
            [TARGET_SERVICE],
            lambda s: target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, s),
        )
        port = await server.start()
        address = f"127.0.0.1:{port}"
        assert await health_status(address) == health_pb2.HealthCheckResponse.NOT_SERVING
        async with grpc.aio.insecure_channel(address) as channel:
            stub = target_pb2_grpc.TargetServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as loading:
                await stub.GetInfo(target_pb2.GetInfoRequest(), timeout=5)
            assert loading.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "loading" in loading.value.details()
            config = TargetServiceConfig(model=str(causal_lm_dir), tap_layer_ids=(0,))
            servicer.runtime = await asyncio.to_thread(TargetRuntime, config)
            await server.set_serving(True)
            assert (
                await health_status(address, TARGET_SERVICE)
                == health_pb2.HealthCheckResponse.SERVING
            )
            # An open session keeps the server in its grace period while we look at health.
            call = stub.RunSession(timeout=30)
            await call.write(target_pb2.RunSessionRequest(open=target_pb2.OpenSession()))
            await call.read()
            stopping = asyncio.ensure_future(server.stop(grace_s=3))
            await asyncio.sleep(0.2)
            status = await health_status_or_unavailable(address)
            assert status in ("NOT_SERVING", "UNAVAILABLE")
            call.cancel()
        await stopping
        servicer.runtime.close()

    asyncio.run(run())


async def health_status_or_unavailable(address: str) -> str:
    """During draining the server may already refuse new RPCs; both mean 'not serving'."""
    try:
        status = await health_status(address)
    except grpc.aio.AioRpcError as error:
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        return "UNAVAILABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(status)


def test_inline_features_are_chunked_and_exact(monkeypatch):
    monkeypatch.setattr(feature_channel, "CHUNK_BYTES", 1000)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        rows = torch.randn(37, 24).to(dtype)
        encoded = encode_inline(rows)
        assert len(encoded.chunks) == -(-rows.numel() * rows.itemsize // 1000)
        assert all(len(chunk) <= 1000 for chunk in encoded.chunks)
        assert torch.equal(decode_inline(encoded, "cpu"), rows)
    truncated = encoded.__class__(37, 24, "float16", encoded.chunks[:-1])
    with pytest.raises(InvalidRequestError, match="bytes received"):
        decode_inline(truncated, "cpu")


def test_loop_with_many_feature_chunks_over_grpc(causal_lm_dir, dflash_dir, monkeypatch):
    """Features cut into many small messages arrive whole: output equals target-only."""
    monkeypatch.setattr(feature_channel, "CHUNK_BYTES", 700)  # < one token row of 576 B … 2 rows

    async def run():
        target_servicer, drafter_servicer = TargetServicer(), DrafterServicer()
        target_server = GrpcServer(
            "127.0.0.1",
            0,
            [TARGET_SERVICE],
            lambda s: target_pb2_grpc.add_TargetServiceServicer_to_server(target_servicer, s),
        )
        from dflash_protos import drafter_pb2_grpc

        drafter_server = GrpcServer(
            "127.0.0.1",
            0,
            [DRAFTER_SERVICE],
            lambda s: drafter_pb2_grpc.add_DrafterServiceServicer_to_server(drafter_servicer, s),
        )
        target_port, drafter_port = await target_server.start(), await drafter_server.start()
        target_servicer.runtime = TargetRuntime(
            TargetServiceConfig(model=str(causal_lm_dir), tap_layer_ids=(0, 2, 4))
        )
        drafter_servicer.runtime = DrafterRuntime(
            DrafterServiceConfig(model=str(dflash_dir), target_model=str(causal_lm_dir))
        )
        target = TargetClient(f"127.0.0.1:{target_port}")
        drafter = DrafterClient(f"127.0.0.1:{drafter_port}")
        outputs = []
        for use_drafter in (False, True):
            session = await target.open(SamplingParams(), "inline" if use_drafter else "none")
            drafter_session = await drafter.open("inline") if use_drafter else None
            run = SpeculativeGeneration(
                session, drafter_session, list(range(3, 40)), StopRules(20), 15, 512
            )
            outputs.append([t async for t in run.tokens()])
            await session.close()
            if drafter_session is not None:
                await drafter_session.close()
        await target.close()
        await drafter.close()
        await target_server.stop(0)
        await drafter_server.stop(0)
        target_servicer.runtime.close()
        drafter_servicer.runtime.close()
        return outputs

    target_only, speculative = asyncio.run(run())
    assert speculative == target_only and len(target_only) == 20
