"""How the gateway opens a request's two sessions: the drafter's first, so that the target's
open is followed at once by the prompt (the target waits for a new session's prompt, see
`DynamicBatcher.open_session`), and nothing is left open when either open fails."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from dflash_protos import target_pb2, target_pb2_grpc
from dflash_serve.speculative.types import SamplingParams
from gateway.config import GatewayConfig
from gateway.generation import Generator, target_unavailable
from gateway.metrics import GatewayMetrics
from gateway.openai_errors import ApiError
from gateway.schemas import GenerationRequest
from gateway.session_calls import SessionStreamEndedError
from gateway.target_client import TargetClient


def rpc_error(service: str, code=grpc.StatusCode.UNAVAILABLE) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), f"{service} down")


class FakeSession:
    def __init__(self, name: str, events: list[str]) -> None:
        self.name, self.events = name, events

    async def close(self) -> None:
        self.events.append(f"close {self.name}")


class FakeBackends:
    """Records each open and close; `failing` maps a service to the error its open raises
    (or to HANG: its open never returns)."""

    def __init__(self, failing: dict[str, BaseException | object]) -> None:
        self.events: list[str] = []
        self.failing = failing
        self.is_drafter_usable, self.feature_transport, self.shared_buffer = True, "inline", None
        self.target, self.drafter = self.Target(self), self.Drafter(self)
        self.drafter_errors: list[Exception] = []

    def drafter_failed(self, error: Exception) -> None:
        self.drafter_errors.append(error)

    async def open(self, name: str, transport: str) -> FakeSession:
        self.events.append(f"open {name} {transport}")
        failure = self.failing.get(name)
        if failure is HANG:
            await asyncio.Event().wait()
        if failure is not None:
            raise failure
        return FakeSession(name, self.events)

    class Target:
        def __init__(self, owner) -> None:
            self.owner = owner

        async def open(self, sampling, transport, timeout_s):
            assert isinstance(sampling, SamplingParams)
            return await self.owner.open("target", transport)

    class Drafter:
        def __init__(self, owner) -> None:
            self.owner = owner

        async def open(self, transport, shared, timeout_s):
            return await self.owner.open("drafter", transport)


HANG = object()
STREAM_ENDED = SessionStreamEndedError("the session stream ended while waiting for opened")


def opening_sessions(backends: FakeBackends):
    config = GatewayConfig(target_address="-", tokenizer_path="-")
    generator = Generator(config, backends, None, GatewayMetrics("test"))
    request = GenerationRequest(is_chat=False, model=None, prompt_ids=(1, 2))
    return generator._open_sessions(request)


def open_sessions(backends: FakeBackends):
    return asyncio.run(opening_sessions(backends))


def test_the_drafter_session_opens_before_the_target_session():
    backends = FakeBackends(failing={})
    target, drafter = open_sessions(backends)
    assert (target.name, drafter.name) == ("target", "drafter")
    assert backends.events == ["open drafter inline", "open target inline"]


@pytest.mark.parametrize(
    "failure, message",
    [(rpc_error("target"), "UNAVAILABLE: target down"), (STREAM_ENDED, "waiting for opened")],
)
def test_a_failed_target_open_is_a_503_and_closes_the_drafter_session(failure, message):
    """An error status, or a stream that ended before "opened" (the service shut down)."""
    backends = FakeBackends(failing={"target": failure})
    with pytest.raises(ApiError) as error:
        open_sessions(backends)
    assert error.value.status == 503 and message in error.value.message
    assert backends.events == ["open drafter inline", "open target inline", "close drafter"]


def test_a_target_open_cancelled_closes_the_drafter_session():
    """The client went away while the target's session was opening."""
    backends = FakeBackends(failing={"target": HANG})

    async def go():
        opening = asyncio.ensure_future(opening_sessions(backends))
        await asyncio.sleep(0.05)
        opening.cancel()
        with pytest.raises(asyncio.CancelledError):
            await opening

    asyncio.run(asyncio.wait_for(go(), 2.0))
    assert backends.events == ["open drafter inline", "open target inline", "close drafter"]


def test_a_target_only_open_that_fails_is_a_503():
    backends = FakeBackends(failing={"target": STREAM_ENDED})
    backends.is_drafter_usable = False
    with pytest.raises(ApiError) as error:
        open_sessions(backends)
    assert error.value.status == 503 and "waiting for opened" in error.value.message


@pytest.mark.parametrize("failure", [rpc_error("drafter"), STREAM_ENDED])
def test_a_failed_drafter_open_falls_back_to_target_only(failure):
    backends = FakeBackends(failing={"drafter": failure})
    target, drafter = open_sessions(backends)
    assert target.name == "target" and drafter is None
    assert backends.events == ["open drafter inline", "open target none"]
    assert len(backends.drafter_errors) == 1


def test_a_full_drafter_runs_the_request_target_only_and_stays_usable():
    """RESOURCE_EXHAUSTED (every drafter session taken) is no failure of the drafter: this
    request alone runs without drafts, and speculation stays on for the others."""
    full = rpc_error("drafter", grpc.StatusCode.RESOURCE_EXHAUSTED)
    backends = FakeBackends(failing={"drafter": full})
    target, drafter = open_sessions(backends)
    assert target.name == "target" and drafter is None
    assert backends.events == ["open drafter inline", "open target none"]
    assert backends.drafter_errors == []


def test_an_unusable_drafter_is_not_opened():
    backends = FakeBackends(failing={})
    backends.is_drafter_usable = False
    target, drafter = open_sessions(backends)
    assert target.name == "target" and drafter is None
    assert backends.events == ["open target none"]


class EndsAfterOpen(target_pb2_grpc.TargetServiceServicer):
    """A target whose session stream ends (status OK) right after "opened": what a target
    shutting down between two steps looks like to the gateway."""

    async def RunSession(self, request_iterator, context):
        await request_iterator.__anext__()
        yield target_pb2.RunSessionResponse(opened=target_pb2.SessionOpened(slot=3))


def test_a_step_on_a_stream_the_target_ended_is_a_stream_end_and_a_503():
    """gRPC refuses the write with InvalidStateError (no error status), which must read as
    the target gone (a 503), not as a bug in the gateway (a 500)."""

    async def go():
        server = grpc.aio.server()
        target_pb2_grpc.add_TargetServiceServicer_to_server(EndsAfterOpen(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client = TargetClient(f"127.0.0.1:{port}", session_transport="grpc")
        try:
            session = await client.open(SamplingParams(), "none", timeout_s=5)
            assert session.slot == 3
            assert await session.call.code() == grpc.StatusCode.OK  # the stream has ended
            with pytest.raises(SessionStreamEndedError) as ended:
                await session.verify([1, 2])
            assert target_unavailable(ended.value).status == 503
        finally:
            await client.close()
            await server.stop(None)

    asyncio.run(asyncio.wait_for(go(), 10))
