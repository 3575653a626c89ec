"""HTTP routes of the OpenAI-compatible API (HTTP JSON stops here)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable
from contextlib import aclosing

from aiohttp import web

from gateway.generation import Finished, Generator
from gateway.openai_errors import ApiError, bad_request, error_response, sse_error_event
from gateway.schemas import GenerationRequest, parse_chat_request, parse_completion_request

logger = logging.getLogger(__name__)

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
RETRY_AFTER_S = "1"


class Admission:
    """At most `max_running` requests generate; at most `max_waiting` more wait; others get 503."""

    def __init__(self, max_running: int, max_waiting: int, metrics, model_name: str) -> None:
        self.semaphore = asyncio.Semaphore(max_running)
        self.max_waiting = max_waiting
        self.num_waiting = 0
        self.metrics = metrics
        self.model_name = model_name

    async def __aenter__(self):
        if self.semaphore.locked() and self.num_waiting >= self.max_waiting:
            raise ApiError(
                503,
                "the server is at capacity; retry shortly",
                headers={"Retry-After": RETRY_AFTER_S},
            )
        self.num_waiting += 1
        self.metrics.waiting.labels(self.model_name).set(self.num_waiting)
        try:
            await self.semaphore.acquire()
        finally:
            self.num_waiting -= 1
            self.metrics.waiting.labels(self.model_name).set(self.num_waiting)
        self.metrics.running.labels(self.model_name).inc()

    async def __aexit__(self, *exc_info):
        self.metrics.running.labels(self.model_name).dec()
        self.semaphore.release()


class Routes:
    def __init__(self, generator: Generator, admission: Admission, model_name: str) -> None:
        self.generator = generator
        self.admission = admission
        self.model_name = model_name

    def register(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)

    async def health(self, request: web.Request) -> web.Response:
        if await self.generator.backends.is_healthy():
            return web.Response(text="")
        return web.json_response({"status": "unavailable"}, status=503)

    async def metrics(self, request: web.Request) -> web.Response:
        body = self.generator.metrics.exposition()
        return web.Response(body=body, content_type="text/plain", charset="utf-8")

    async def models(self, request: web.Request) -> web.Response:
        info = self.generator.backends.target_info
        card = {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "dflash-serve",
            "root": info.model_name if info else self.model_name,
            "max_model_len": info.max_context_tokens if info else None,
        }
        return web.json_response({"object": "list", "data": [card]})

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request)
            parse = parse_chat_request if "messages" in body else parse_completion_request
            parsed = parse(body)
            self._check_model(parsed)
            self._check_ready()
            ids = self.generator.prompt_ids(parsed)
        except ApiError as error:
            return error_response(error)
        limit = self.generator.backends.target_info.max_context_tokens
        return web.json_response({"count": len(ids), "max_model_len": limit, "tokens": ids})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, parse_chat_request, ChatFormat())

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, parse_completion_request, CompletionFormat())

    async def _complete(self, request: web.Request, parse: Callable, fmt) -> web.StreamResponse:
        try:
            parsed = parse(await self._json(request))
            self._check_model(parsed)
            self._check_ready()
            prompt_ids = self.generator.prompt_ids(parsed)
            self.generator.max_new_tokens(parsed, len(prompt_ids))
            async with self.admission:
                if parsed.stream:
                    return await self._stream(request, parsed, prompt_ids, fmt)
                return await self._whole(parsed, prompt_ids, fmt)
        except ApiError as error:
            return error_response(error)
        except Exception as error:  # a bug must still answer in the API's error shape
            logger.exception("internal error")
            return error_response(ApiError(500, f"internal error: {type(error).__name__}"))

    async def _whole(self, parsed: GenerationRequest, prompt_ids, fmt) -> web.Response:
        texts = []
        async with aclosing(self.generator.generate(parsed, prompt_ids)) as events:
            async for event in events:
                if isinstance(event, Finished):
                    return web.json_response(fmt.whole(self.model_name, "".join(texts), event))
                texts.append(event.text)
        raise AssertionError("generation ended without a Finished event")

    async def _stream(self, request, parsed: GenerationRequest, prompt_ids, fmt):
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        chunks = fmt.chunks(self.model_name)
        try:
            await response.write(sse(chunks.first()))
            async with aclosing(self.generator.generate(parsed, prompt_ids)) as events:
                async for event in events:
                    if isinstance(event, Finished):
                        await response.write(sse(chunks.finish(event.finish_reason)))
                        if parsed.include_usage:
                            await response.write(sse(chunks.usage(event.usage.as_dict())))
                    else:
                        await response.write(sse(chunks.text(event.text)))
        except ApiError as error:
            logger.warning("stream ended by error: %s", error.message)
            await response.write(sse_error_event(error))
        except ConnectionResetError:
            raise  # the client left: nothing to report to
        except Exception as error:  # headers are sent: report in-band, then [DONE]
            logger.exception("internal error while streaming")
            await response.write(sse_error_event(ApiError(500, f"internal error: {error}")))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _json(self, request: web.Request):
        try:
            return await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise bad_request(f"malformed JSON body: {error}") from error

    def _check_model(self, parsed: GenerationRequest) -> None:
        info = self.generator.backends.target_info
        known = {self.model_name, info.model_name if info else self.model_name}
        if parsed.model is not None and parsed.model not in known:
            raise ApiError(404, f"The model `{parsed.model}` does not exist.", "model")

    def _check_ready(self) -> None:
        if self.generator.backends.target_info is None:
            raise ApiError(
                503,
                "the target service is not ready yet; retry shortly",
                headers={"Retry-After": RETRY_AFTER_S},
            )


def sse(payload: dict) -> bytes:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


class ChatFormat:
    def whole(self, model: str, text: str, finished: Finished) -> dict:
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": finished.finish_reason,
                }
            ],
            "usage": finished.usage.as_dict(),
        }

    def chunks(self, model: str) -> ChunkMaker:
        return ChunkMaker(f"chatcmpl-{uuid.uuid4().hex}", "chat.completion.chunk", model, True)


class CompletionFormat:
    def whole(self, model: str, text: str, finished: Finished) -> dict:
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": finished.finish_reason,
                }
            ],
            "usage": finished.usage.as_dict(),
        }

    def chunks(self, model: str) -> ChunkMaker:
        return ChunkMaker(f"cmpl-{uuid.uuid4().hex}", "text_completion", model, False)


class ChunkMaker:
    """SSE chunk payloads of one streamed response, as vLLM shapes them."""

    def __init__(self, response_id: str, obj: str, model: str, is_chat: bool) -> None:
        self.base = {"id": response_id, "object": obj, "created": int(time.time()), "model": model}
        self.is_chat = is_chat

    def _choice(self, text: str | None, finish_reason: str | None, role: bool = False) -> dict:
        if self.is_chat:
            delta = {} if text is None else {"content": text}
            if role:
                delta = {"role": "assistant", "content": ""}
            choice = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text or ""}
        return {**choice, "logprobs": None, "finish_reason": finish_reason}

    def first(self) -> dict:
        return {**self.base, "choices": [self._choice("", None, role=True)]}

    def text(self, text: str) -> dict:
        return {**self.base, "choices": [self._choice(text, None)]}

    def finish(self, finish_reason: str) -> dict:
        return {**self.base, "choices": [self._choice(None, finish_reason)]}

    def usage(self, usage: dict) -> dict:
        return {**self.base, "choices": [], "usage": usage}
