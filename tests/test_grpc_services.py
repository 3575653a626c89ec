"""The target and drafter services as real processes, driven over gRPC and over their local
session sockets (CPU, inline features): both transports give the same tokens, the same
errors and the same session lifetimes."""

from __future__ import annotations

import asyncio
import os
import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from dflash_protos import target_pb2, target_pb2_grpc
from dflash_serve.session_socket.call import SessionSocketCall
from dflash_serve.session_socket.framing import ERROR
from dflash_serve.speculative.loop import SpeculativeGeneration, StopRules
from dflash_serve.speculative.types import SamplingParams
from gateway.drafter_client import DrafterClient
from gateway.target_client import TargetClient
from launcher.service_processes import start_service
from target_service.engine import TargetEngine
from target_service.model.loader import load_target_model
from target_service.model.state import StateShape
from target_service.session import InProcessTarget
from tests.raw_session import open_with_deadline, read_last_frame
from tests.speculative_harness import generate

MAX_SESSIONS = 16
MAX_CONTEXT = 256
PROMPTS = [[5, 17, 33, 2, 99], [7] * 12, [120, 3, 44, 61, 12, 150, 8, 9]]
MAX_NEW = 30


@pytest.fixture(scope="module")
def services(causal_lm_dir, dflash_dir):
    common = ["--max-sessions", str(MAX_SESSIONS), "--max-context-tokens", str(MAX_CONTEXT)]
    common += ["--max-wait-us", "5000"]
    target = start_service(
        ["target", "--model", str(causal_lm_dir), "--drafter-model", str(dflash_dir), *common]
    )
    try:
        drafter = start_service(
            ["drafter", "--model", str(dflash_dir), "--target-model", str(causal_lm_dir), *common]
        )
    except Exception:
        target.stop()
        raise
    yield target, drafter
    target.stop()
    drafter.stop()


@pytest.fixture(scope="module")
def reference(causal_lm_dir, dflash_dir):
    """Target-only output computed in this process (the oracle)."""
    from drafter_service.model.config import load_dflash_config

    taps = load_dflash_config(dflash_dir).target_layer_ids
    engine = TargetEngine(load_target_model(causal_lm_dir), StateShape(4, MAX_CONTEXT), taps)
    target = InProcessTarget(engine)

    def solo(prompt, sampling):
        return asyncio.run(generate(target, None, prompt, sampling, MAX_NEW, 15))[0]

    yield solo
    target.close()


async def remote_generate(
    target_address, drafter_address, prompt, sampling, num_drafts=15, transport="grpc"
):
    """`transport`: "grpc", or "socket" (the services' local session sockets, which the
    clients find through GetInfo)."""
    session_transport = "auto" if transport == "socket" else "grpc"
    target = TargetClient(target_address, session_transport=session_transport)
    drafter = DrafterClient(drafter_address, session_transport=session_transport)
    try:
        info = await target.info()
        await drafter.info()
        assert (target.sessions.transport, drafter.sessions.transport) == (transport, transport)
        target_session = await target.open(sampling, "inline", timeout_s=60)
        drafter_session = await drafter.open("inline", timeout_s=60) if drafter_address else None
        run = SpeculativeGeneration(
            target_session,
            drafter_session,
            prompt,
            StopRules(MAX_NEW, frozenset(info.eos_token_ids)),
            num_drafts,
            info.max_context_tokens,
        )
        try:
            return [t async for t in run.tokens()], run.stats
        finally:
            await target_session.close()
            if drafter_session is not None:
                await drafter_session.close()
    finally:
        await target.close()
        await drafter.close()


@pytest.mark.parametrize("transport", ["grpc", "socket"])
@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=99)],
    ids=["greedy", "seeded"],
)
def test_loop_over_services_equals_in_process(services, reference, sampling, transport):
    target, drafter = services
    for prompt in PROMPTS:
        tokens, stats = asyncio.run(
            remote_generate(target.address, drafter.address, prompt, sampling, transport=transport)
        )
        assert tokens == reference(prompt, sampling)
        assert stats.num_drafts > 0


def test_sixteen_concurrent_sessions_get_their_solo_output(services, reference):
    """Half of them over gRPC, half over the session sockets, batched together."""
    target, drafter = services
    cases = [(PROMPTS[i % 3], SamplingParams(temperature=(i % 2) * 0.9, seed=i)) for i in range(16)]
    transports = ["grpc", "socket"] * 8

    async def run_all():
        async with grpc.aio.insecure_channel(target.address) as channel:
            # Sessions of earlier tests are freed asynchronously after their streams end.
            assert await wait_for_active(target_pb2_grpc.TargetServiceStub(channel), 0) == 0
        results = await asyncio.gather(
            *(
                remote_generate(target.address, drafter.address, p, s, transport=t)
                for (p, s), t in zip(cases, transports, strict=True)
            )
        )
        client_t, client_d = TargetClient(target.address), DrafterClient(drafter.address)
        stats = await client_t.stats(), await client_d.stats()
        # Ended streams free their sessions asynchronously: poll until both report zero.
        for _ in range(100):
            active = (
                (await client_t.stats())["num_active_sessions"],
                (await client_d.stats())["num_active_sessions"],
            )
            if active == (0, 0):
                break
            await asyncio.sleep(0.05)
        stats[0]["num_active_sessions"], stats[1]["num_active_sessions"] = active
        await client_t.close()
        await client_d.close()
        return results, stats

    results, (target_stats, drafter_stats) = asyncio.run(run_all())
    for (prompt, sampling), (tokens, _) in zip(cases, results, strict=True):
        assert tokens == reference(prompt, sampling)
    assert target_stats["max_verify_batch_size"] > 1, target_stats
    assert drafter_stats["max_draft_batch_size"] > 1, drafter_stats
    assert target_stats["verify_wait_us"] > 0 and drafter_stats["draft_wait_us"] >= 0
    # On the CPU path every batch runs on the engine thread.
    assert target_stats["num_inline_verify_batches"] == 0
    assert drafter_stats["num_inline_draft_batches"] == 0
    assert target_stats["num_active_sessions"] == 0
    assert drafter_stats["num_active_sessions"] == 0


def test_health_and_reflection(services):
    for service, name in zip(
        services,
        ("dflash.target.v1.TargetService", "dflash.drafter.v1.DrafterService"),
        strict=True,
    ):
        with grpc.insecure_channel(service.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for key in ("", name):
                status = health.Check(health_pb2.HealthCheckRequest(service=key), timeout=5)
                assert status.status == health_pb2.HealthCheckResponse.SERVING
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            response = next(stub.ServerReflectionInfo(iter([request]), timeout=5))
            listed = {s.name for s in response.list_services_response.service}
            assert {name, "grpc.health.v1.Health"} <= listed


async def active_sessions(stub) -> int:
    stats = await stub.GetStats(target_pb2.GetStatsRequest(), timeout=5)
    return stats.num_active_sessions


async def wait_for_active(stub, expected: int, timeout_s: float = 10.0) -> int:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while (count := await active_sessions(stub)) != expected:
        if asyncio.get_running_loop().time() > deadline:
            return count
        await asyncio.sleep(0.05)
    return count


def open_message(**sampling):
    return target_pb2.RunSessionRequest(
        open=target_pb2.OpenSession(sampling=target_pb2.SamplingParams(**sampling))
    )


async def open_call(transport: str, stub, info, timeout_s: float | None = None):
    """A target session stream over gRPC or over the target's session socket."""
    if transport == "grpc":
        return stub.RunSession(timeout=timeout_s)
    return await SessionSocketCall.connect(
        info.session_socket, target_pb2.RunSessionResponse, timeout_s
    )


@pytest.mark.parametrize("transport", ["grpc", "socket"])
def test_cancelled_stream_and_deadline_free_the_slot(services, transport):
    target, _ = services

    async def run():
        async with grpc.aio.insecure_channel(target.address) as channel:
            stub = target_pb2_grpc.TargetServiceStub(channel)
            info = await stub.GetInfo(target_pb2.GetInfoRequest(), timeout=5)
            assert await wait_for_active(stub, 0) == 0
            call = await open_call(transport, stub, info)
            await call.write(open_message())
            await call.read()
            assert await active_sessions(stub) == 1
            call.cancel()
            assert await wait_for_active(stub, 0) == 0
            if transport == "grpc":
                call = await open_call(transport, stub, info, timeout_s=0.5)
                await call.write(open_message())
                await call.read()
            else:  # a raw connection: SessionSocketCall would end it itself at the deadline
                reader, writer = await open_with_deadline(
                    info.session_socket, 500_000, open_message()
                )
            await asyncio.sleep(1.0)
            # The service freed the slot at the deadline, the client doing nothing meanwhile.
            assert await active_sessions(stub) == 0
            if transport == "grpc":
                assert await call.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            else:
                kind, code = await read_last_frame(reader, writer)
                assert kind == ERROR
                assert code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]

    asyncio.run(run())


async def session_error(open_session, *messages) -> grpc.StatusCode:
    call = await open_session()
    try:
        for message in messages:
            await call.write(message)
            await call.read()
    except grpc.aio.AioRpcError as error:
        return error.code(), error.details()
    finally:
        call.cancel()
    return grpc.StatusCode.OK, ""


@pytest.mark.parametrize("transport", ["grpc", "socket"])
def test_malformed_requests_get_status_codes_and_the_server_stays_up(services, transport):
    target, _ = services
    prefill = target_pb2.RunSessionRequest

    async def run():
        async with grpc.aio.insecure_channel(target.address) as channel:
            stub = target_pb2_grpc.TargetServiceStub(channel)
            info = await stub.GetInfo(target_pb2.GetInfoRequest(), timeout=5)
            assert await wait_for_active(stub, 0) == 0

            async def open_session():
                return await open_call(transport, stub, info, timeout_s=30)

            cases = {
                "before open": [prefill(prefill=target_pb2.Prefill(prompt_ids=[1]))],
                "bad id": [open_message(), prefill(prefill=target_pb2.Prefill(prompt_ids=[10**6]))],
                "empty prompt": [open_message(), prefill(prefill=target_pb2.Prefill())],
                "too long": [
                    open_message(),
                    prefill(prefill=target_pb2.Prefill(prompt_ids=[1] * (MAX_CONTEXT + 1))),
                ],
                "bad top_p": [open_message(temperature=1.0, top_p=1.5)],
                "verify 17": [
                    open_message(),
                    prefill(prefill=target_pb2.Prefill(prompt_ids=[1, 2])),
                    prefill(verify=target_pb2.Verify(block_ids=list(range(17)))),
                ],
                "open twice": [open_message(), open_message()],
            }
            for name, messages in cases.items():
                code, details = await session_error(open_session, *messages)
                assert code == grpc.StatusCode.INVALID_ARGUMENT, (name, code, details)
                assert details, name
            calls = []
            for _ in range(MAX_SESSIONS):
                call = await open_session()
                await call.write(open_message())
                await call.read()
                calls.append(call)
            code, details = await session_error(open_session, open_message())
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
            assert "slots are in use" in details
            for call in calls:
                call.cancel()
            assert await wait_for_active(stub, 0) == 0
            info = await stub.GetInfo(target_pb2.GetInfoRequest(), timeout=5)
            assert info.max_sessions == MAX_SESSIONS

    asyncio.run(run())


async def info_and_transport(address: str) -> tuple[str, str]:
    client = TargetClient(address)
    try:
        info = await client.stub.GetInfo(target_pb2.GetInfoRequest(), timeout=5)
        await client.info()
        return info.session_socket, client.sessions.transport
    finally:
        await client.close()


def test_sigterm_drains_and_exits_cleanly(causal_lm_dir):
    service = start_service(["target", "--model", str(causal_lm_dir), "--grace-period-s", "1"])
    path, transport = asyncio.run(info_and_transport(service.address))
    assert transport == "socket" and os.path.exists(path)
    service.process.send_signal(signal.SIGTERM)
    assert service.process.wait(timeout=20) == 0
    assert any("draining" in line for line in service.log)
    assert not os.path.exists(path)  # the session socket is removed on the way out


def test_sigterm_lets_an_open_socket_session_finish_within_the_grace_period(causal_lm_dir):
    service = start_service(["target", "--model", str(causal_lm_dir), "--grace-period-s", "20"])

    async def run():
        client = TargetClient(service.address)
        await client.info()
        assert client.sessions.transport == "socket"
        session = await client.open(SamplingParams(), "none", timeout_s=30)
        first = await session.prefill([5, 17, 33])
        service.process.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.5)  # draining now
        step = await session.verify([first.token_ids[-1]])  # the open session goes on
        await session.close()
        await client.close()
        return step

    try:
        step = asyncio.run(run())
        assert len(step.token_ids) == 1
        assert service.process.wait(timeout=10) == 0  # well before the 20 s grace: none open
        assert any("draining" in line for line in service.log)
    finally:
        service.stop()


def test_without_a_session_socket_clients_use_grpc(causal_lm_dir):
    service = start_service(["target", "--model", str(causal_lm_dir), "--session-socket", "off"])
    try:
        assert asyncio.run(info_and_transport(service.address)) == ("", "grpc")
    finally:
        service.stop()
