"""How the gateway opens a request's two sessions: both at once, the prompt going to the
target as soon as its session is open (the target waits for a new session's prompt, see
`DynamicBatcher.open_session`) and the drafter's open awaited only at the first draft;
nothing is left open when either open fails, and a failed drafter costs only speed."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from dflash_protos import target_pb2, target_pb2_grpc
from dflash_serve.speculative.pending_drafter import PendingDrafterSession
from dflash_serve.speculative.types import SamplingParams, TargetStep
from gateway.config import GatewayConfig
from gateway.generation import Finished, Generator, TextDelta, target_unavailable
from gateway.metrics import GatewayMetrics
from gateway.openai_errors import ApiError
from gateway.schemas import GenerationRequest
from gateway.session_calls import SessionStreamEndedError
from gateway.target_client import TargetClient


def rpc_error(service: str, code=grpc.StatusCode.UNAVAILABLE) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), f"{service} down")


class FakeSession:
    """A target session that answers every step with the next byte of "ABC…" and drafts
    nothing; a drafter session that proposes nothing."""

    def __init__(self, name: str, events: list[str]) -> None:
        self.name, self.events, self.next_token = name, events, ord("A")

    async def prefill(self, prompt_ids):
        return self._step()

    async def verify(self, block_ids):
        return self._step()

    async def draft(self, features, anchor_id, num_drafts):
        self.events.append("draft")
        return []

    def _step(self) -> TargetStep:
        token, self.next_token = self.next_token, self.next_token + 1
        return TargetStep([token], 0, None)

    async def close(self) -> None:
        self.events.append(f"close {self.name}")


class FakeBackends:
    """Records each open, cancelled open and close; `failing` maps a service to the error its
    open raises (or to HANG: its open never returns); `delays_s` how long each open takes."""

    def __init__(self, failing: dict[str, BaseException | object], **delays_s: float) -> None:
        self.events: list[str] = []
        self.failing = failing
        self.delays_s = {"target": 0.01, "drafter": 0.01} | delays_s
        self.is_drafter_usable, self.feature_transport, self.shared_buffer = True, "inline", None
        self.target, self.drafter = self.Target(self), self.Drafter(self)
        self.drafter_errors: list[Exception] = []
        self.target_info = SimpleNamespace(vocab_size=256, eos_token_ids=(), max_context_tokens=64)

    def drafter_failed(self, error: Exception) -> None:
        self.drafter_errors.append(error)

    async def open(self, name: str, transport: str) -> FakeSession:
        self.events.append(f"open {name} {transport}")
        try:
            await asyncio.sleep(self.delays_s[name])
            failure = self.failing.get(name)
            if failure is HANG:
                await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.events.append(f"cancel {name}")
            raise
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


class ByteDecoder:
    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return bytes(ids).decode(errors="replace")


def generator_for(backends: FakeBackends) -> Generator:
    config = GatewayConfig(target_address="-", tokenizer_path="-")
    return Generator(config, backends, ByteDecoder(), GatewayMetrics("test"))


REQUEST = GenerationRequest(is_chat=False, model=None, prompt_ids=(1, 2), max_tokens=3)


def open_sessions(backends: FakeBackends):
    return asyncio.run(generator_for(backends)._open_sessions(REQUEST))


def generate(backends: FakeBackends) -> str:
    """The request's whole text (three tokens: "ABC")."""

    async def go():
        events = [e async for e in generator_for(backends).generate(REQUEST, [1, 2])]
        assert isinstance(events[-1], Finished)
        return "".join(e.text for e in events if isinstance(e, TextDelta))

    return asyncio.run(asyncio.wait_for(go(), 5.0))


def test_the_target_session_opens_without_waiting_for_the_drafters():
    """The drafter's open never returns: the target's session is open regardless, so the
    prompt can go; closing the pending drafter session stops its open."""
    backends = FakeBackends(failing={"drafter": HANG})

    async def go():
        target, drafter = await generator_for(backends)._open_sessions(REQUEST)
        assert target.name == "target" and isinstance(drafter, PendingDrafterSession)
        await drafter.close()

    asyncio.run(asyncio.wait_for(go(), 2.0))
    assert backends.events == ["open target inline", "open drafter inline", "cancel drafter"]


def test_a_request_drafts_through_the_session_opened_alongside():
    backends = FakeBackends(failing={})
    assert generate(backends) == "ABC"
    assert backends.events.count("draft") == 1  # the last step (budget 0) drafts nothing
    assert backends.events[-2:] == ["close target", "close drafter"]
    assert backends.drafter_errors == []


@pytest.mark.parametrize(
    "failure, message",
    [(rpc_error("target"), "UNAVAILABLE: target down"), (STREAM_ENDED, "waiting for opened")],
)
def test_a_failed_target_open_is_a_503_and_closes_the_drafter_session(failure, message):
    """An error status, or a stream that ended before "opened" (the service shut down); the
    drafter's session opened first and is closed."""
    backends = FakeBackends(failing={"target": failure}, target=0.05, drafter=0.0)
    with pytest.raises(ApiError) as error:
        open_sessions(backends)
    assert error.value.status == 503 and message in error.value.message
    assert backends.events == ["open target inline", "open drafter inline", "close drafter"]


def test_a_failed_target_open_stops_the_drafters_open():
    backends = FakeBackends(failing={"target": rpc_error("target"), "drafter": HANG})
    with pytest.raises(ApiError):
        open_sessions(backends)
    assert backends.events == ["open target inline", "open drafter inline", "cancel drafter"]


def test_a_target_open_cancelled_closes_the_drafter_session():
    """The client went away while the target's session was opening."""
    backends = FakeBackends(failing={"target": HANG})

    async def go():
        opening = asyncio.ensure_future(generator_for(backends)._open_sessions(REQUEST))
        await asyncio.sleep(0.05)
        opening.cancel()
        with pytest.raises(asyncio.CancelledError):
            await opening

    asyncio.run(asyncio.wait_for(go(), 2.0))
    assert backends.events == [
        "open target inline",
        "open drafter inline",
        "cancel target",
        "close drafter",
    ]


def test_a_target_only_open_that_fails_is_a_503():
    backends = FakeBackends(failing={"target": STREAM_ENDED})
    backends.is_drafter_usable = False
    with pytest.raises(ApiError) as error:
        open_sessions(backends)
    assert error.value.status == 503 and "waiting for opened" in error.value.message


@pytest.mark.parametrize("failure", [rpc_error("drafter"), STREAM_ENDED])
def test_a_failed_drafter_open_costs_only_the_drafts(failure):
    """The same text, target-only, and the drafter is reported failed."""
    backends = FakeBackends(failing={"drafter": failure})
    assert generate(backends) == "ABC"
    assert "draft" not in backends.events and backends.events[-1] == "close target"
    assert backends.drafter_errors == [failure]


def test_a_failed_drafter_open_is_reported_though_the_request_never_drafts():
    """One token: the loop never drafts, yet the next requests must learn of the failure."""
    backends = FakeBackends(failing={"drafter": rpc_error("drafter")}, target=0.05, drafter=0.0)
    request = GenerationRequest(is_chat=False, model=None, prompt_ids=(1, 2), max_tokens=1)

    async def go():
        generator = generator_for(backends)
        return [e async for e in generator.generate(request, [1, 2])]

    events = asyncio.run(asyncio.wait_for(go(), 5.0))
    assert [e.text for e in events if isinstance(e, TextDelta)] == ["A"]
    assert backends.drafter_errors == [backends.failing["drafter"]]


def test_a_full_drafter_runs_the_request_target_only_and_stays_usable():
    """RESOURCE_EXHAUSTED (every drafter session taken) is no failure of the drafter: this
    request alone runs without drafts, and speculation stays on for the others."""
    full = rpc_error("drafter", grpc.StatusCode.RESOURCE_EXHAUSTED)
    backends = FakeBackends(failing={"drafter": full})
    assert generate(backends) == "ABC"
    assert "draft" not in backends.events
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
