"""One request from prompt to finished text: sessions, the speculative loop, detokenizing,
stops, usage and metrics. Routes turn its events into JSON or SSE."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from dflash_serve.speculative.loop import (
    FINISH_LENGTH,
    FINISH_STOP,
    SpeculativeGeneration,
    StopRules,
)
from dflash_serve.speculative.pacing import DraftPacing, StepCosts
from dflash_serve.speculative.pending_drafter import PendingDrafterSession
from gateway.backends import Backends
from gateway.config import GatewayConfig
from gateway.detokenizer import IncrementalDetokenizer
from gateway.metrics import GatewayMetrics
from gateway.openai_errors import ApiError, bad_request
from gateway.schemas import GenerationRequest
from gateway.session_calls import SessionStreamEndedError
from gateway.stop_strings import StopStringMatcher

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    def as_dict(self) -> dict:
        total = self.prompt_tokens + self.completion_tokens
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": total,
        }


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class Finished:
    finish_reason: str
    usage: Usage


# How a service's failure reaches the gateway: an error status, or a stream that ended early.
SERVICE_FAILURES = (grpc.aio.AioRpcError, SessionStreamEndedError)


def target_unavailable(error: Exception) -> ApiError:
    if isinstance(error, grpc.aio.AioRpcError):
        return ApiError(503, f"the target service failed: {error.code().name}: {error.details()}")
    return ApiError(503, f"the target service failed: {error}")


def is_full(error: Exception) -> bool:
    """Every session of the service is taken (RESOURCE_EXHAUSTED): busy, not broken."""
    return (
        isinstance(error, grpc.aio.AioRpcError)
        and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    )


class Generator:
    """Runs requests against the backends; one instance per gateway."""

    def __init__(self, config: GatewayConfig, backends: Backends, tokenizer, metrics) -> None:
        self.config = config
        self.backends = backends
        self.tokenizer = tokenizer
        self.metrics: GatewayMetrics = metrics
        self.step_costs = StepCosts()  # what drafted and plain steps cost, over all requests

    def prompt_ids(self, request: GenerationRequest) -> list[int]:
        if request.prompt_ids is not None:
            ids = list(request.prompt_ids)
        elif request.is_chat:
            text = self.tokenizer.apply_chat_template(
                list(request.messages),
                tokenize=False,
                add_generation_prompt=True,
                **request.chat_template_kwargs,
            )
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = self.tokenizer.encode(request.prompt, add_special_tokens=False)
        info = self.backends.target_info
        if not ids:
            raise bad_request("the prompt is empty after tokenization", "prompt")
        if any(not 0 <= i < info.vocab_size for i in ids):
            raise bad_request(f"prompt token ids must be in 0..{info.vocab_size - 1}", "prompt")
        return ids

    def max_new_tokens(self, request: GenerationRequest, num_prompt: int) -> int:
        limit = self.backends.target_info.max_context_tokens
        room = limit - num_prompt
        wanted = request.max_tokens if request.max_tokens is not None else room
        if room < 1 or wanted > room:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {num_prompt + wanted} tokens ({num_prompt} in the messages, "
                f"{wanted} in the completion). Please reduce the length of the messages or "
                "completion.",
                "messages" if request.is_chat else "prompt",
            )
        return wanted

    async def generate(
        self, request: GenerationRequest, prompt_ids: list[int]
    ) -> AsyncIterator[TextDelta | Finished]:
        """Text deltas as tokens are committed, then one Finished."""
        began = time.monotonic()
        info = self.backends.target_info
        stop_ids = set(request.stop_token_ids)
        if not request.ignore_eos:
            stop_ids |= set(info.eos_token_ids)
        stops = StopRules(self.max_new_tokens(request, len(prompt_ids)), frozenset(stop_ids))
        detokenizer = IncrementalDetokenizer(self.tokenizer)
        matcher = StopStringMatcher(list(request.stop_strings))
        pacing = DraftPacing(self.step_costs) if self.config.adaptive_drafting else None
        num_tokens, finish_reason, first_token_at = 0, None, None
        target_session, drafter_session = await self._open_sessions(request)
        run = SpeculativeGeneration(
            target_session,
            drafter_session,
            prompt_ids,
            stops,
            self.config.num_drafts,
            info.max_context_tokens,
            pacing,
        )
        steps = run.steps()
        try:
            # A step's tokens go out together: one detokenization and one streamed chunk
            # per step, not per token (at τ = 6 and 8 streams, ~6 × 8 of each per step, one
            # after another on this process's loop). With stop strings, token by token, so
            # that the usage counts the tokens up to the one that completed a stop string.
            async for step_ids in steps:
                first_token_at = first_token_at or time.monotonic()
                parts = [step_ids] if not matcher.stop_strings else [[t] for t in step_ids]
                text, stopped = "", False
                for ids in parts:
                    num_tokens += len(ids)
                    # The loop ends right after a stop token; its text is not shown.
                    shown = [token for token in ids if token not in stop_ids]
                    part_text, stopped = matcher.push(detokenizer.extend(shown))
                    text += part_text
                    if stopped:
                        break
                if text:
                    yield TextDelta(text)
                if stopped:
                    finish_reason = FINISH_STOP
                    break
            if finish_reason is None:
                finish_reason = run.finish_reason or FINISH_LENGTH
                text, stopped = matcher.push(detokenizer.flush())
                text += "" if stopped else matcher.flush()
                finish_reason = FINISH_STOP if stopped else finish_reason
                if text:
                    yield TextDelta(text)
        except SERVICE_FAILURES as error:
            raise target_unavailable(error) from error
        finally:
            await steps.aclose()
            await target_session.close()
            if drafter_session is not None:
                await drafter_session.close()
            failed_open = None if drafter_session is None else drafter_session.open_error
            if run.drafter_error is not None and run.drafter_error is not failed_open:
                self.backends.drafter_failed(run.drafter_error)  # (open: reported at once)
        usage = Usage(len(prompt_ids), num_tokens)
        ttft = None if first_token_at is None else first_token_at - began
        self.metrics.record_request(
            len(prompt_ids), num_tokens, finish_reason, run.stats, ttft, time.monotonic() - began
        )
        yield Finished(finish_reason, usage)

    async def _open_sessions(self, request: GenerationRequest):
        """Both sessions at once, the drafter's as a PendingDrafterSession: from its open on,
        the target waits for a session's prompt (so that sessions opening together share a
        prefill forward), so the prompt goes as soon as the target's session is open, and
        the drafter's open overlaps the prefill (pending_drafter.py says why). The target
        exports features from its open on; should the drafter's open fail, the loop goes on
        target-only and the failure is reported unless the drafter was only full."""
        backends, timeout = self.backends, self.config.request_timeout_s
        if not backends.is_drafter_usable:
            return await self._open_target_only(request)
        transport = backends.feature_transport
        drafter_session = PendingDrafterSession(
            backends.drafter.open(transport, backends.shared_buffer, timeout),
            self._drafter_open_failed,
        )
        try:
            target_session = await backends.target.open(request.sampling, transport, timeout)
        except BaseException as error:
            await drafter_session.close()
            if isinstance(error, SERVICE_FAILURES):
                raise target_unavailable(error) from error
            raise
        return target_session, drafter_session

    def _drafter_open_failed(self, error: BaseException) -> None:
        """Reported at once, not at the request's end: a request that never drafts (one
        token, a failed prefill) must not hide a broken drafter from the next ones."""
        if not is_full(error):  # a full drafter has not failed
            self.backends.drafter_failed(error)

    async def _open_target_only(self, request: GenerationRequest):
        try:
            timeout = self.config.request_timeout_s
            return await self.backends.target.open(request.sampling, "none", timeout), None
        except SERVICE_FAILURES as error:
            raise target_unavailable(error) from error
