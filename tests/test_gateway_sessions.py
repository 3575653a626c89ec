"""How the gateway opens a request's two sessions: the drafter's first, so that the target's
open is followed at once by the prompt (the target waits for a new session's prompt, see
`DynamicBatcher.open_session`), and nothing is left open when either open fails."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from dflash_serve.speculative.types import SamplingParams
from gateway.config import GatewayConfig
from gateway.generation import Generator
from gateway.metrics import GatewayMetrics
from gateway.openai_errors import ApiError
from gateway.schemas import GenerationRequest


def rpc_error(service: str, code=grpc.StatusCode.UNAVAILABLE) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), f"{service} down")


class FakeSession:
    def __init__(self, name: str, events: list[str]) -> None:
        self.name, self.events = name, events

    async def close(self) -> None:
        self.events.append(f"close {self.name}")


class FakeBackends:
    """Records each open and close; `failing` names the services whose open fails (with
    `code`)."""

    def __init__(self, failing: set[str], code=grpc.StatusCode.UNAVAILABLE) -> None:
        self.events: list[str] = []
        self.failing, self.code = failing, code
        self.is_drafter_usable, self.feature_transport, self.shared_buffer = True, "inline", None
        self.target, self.drafter = self.Target(self), self.Drafter(self)
        self.drafter_errors: list[Exception] = []

    def drafter_failed(self, error: Exception) -> None:
        self.drafter_errors.append(error)

    def open(self, name: str, transport: str) -> FakeSession:
        self.events.append(f"open {name} {transport}")
        if name in self.failing:
            raise rpc_error(name, self.code)
        return FakeSession(name, self.events)

    class Target:
        def __init__(self, owner) -> None:
            self.owner = owner

        async def open(self, sampling, transport, timeout_s):
            assert isinstance(sampling, SamplingParams)
            return self.owner.open("target", transport)

    class Drafter:
        def __init__(self, owner) -> None:
            self.owner = owner

        async def open(self, transport, shared, timeout_s):
            return self.owner.open("drafter", transport)


def open_sessions(backends: FakeBackends):
    config = GatewayConfig(target_address="-", tokenizer_path="-")
    generator = Generator(config, backends, None, GatewayMetrics("test"))
    request = GenerationRequest(is_chat=False, model=None, prompt_ids=(1, 2))
    return asyncio.run(generator._open_sessions(request))


def test_the_drafter_session_opens_before_the_target_session():
    backends = FakeBackends(failing=set())
    target, drafter = open_sessions(backends)
    assert (target.name, drafter.name) == ("target", "drafter")
    assert backends.events == ["open drafter inline", "open target inline"]


def test_a_failed_target_open_closes_the_drafter_session():
    backends = FakeBackends(failing={"target"})
    with pytest.raises(ApiError) as error:
        open_sessions(backends)
    assert error.value.status == 503 and "target down" in error.value.message
    assert backends.events == ["open drafter inline", "open target inline", "close drafter"]


def test_a_failed_drafter_open_falls_back_to_target_only():
    backends = FakeBackends(failing={"drafter"})
    target, drafter = open_sessions(backends)
    assert target.name == "target" and drafter is None
    assert backends.events == ["open drafter inline", "open target none"]
    assert len(backends.drafter_errors) == 1


def test_a_full_drafter_runs_the_request_target_only_and_stays_usable():
    """RESOURCE_EXHAUSTED (every drafter session taken) is no failure of the drafter: this
    request alone runs without drafts, and speculation stays on for the others."""
    backends = FakeBackends(failing={"drafter"}, code=grpc.StatusCode.RESOURCE_EXHAUSTED)
    target, drafter = open_sessions(backends)
    assert target.name == "target" and drafter is None
    assert backends.events == ["open drafter inline", "open target none"]
    assert backends.drafter_errors == []


def test_an_unusable_drafter_is_not_opened():
    backends = FakeBackends(failing=set())
    backends.is_drafter_usable = False
    target, drafter = open_sessions(backends)
    assert target.name == "target" and drafter is None
    assert backends.events == ["open target none"]
