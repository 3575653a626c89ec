"""Request bodies of the OpenAI API → typed requests, validated at the edge.

Every field that would change the output is either honoured exactly or refused with a 400
naming it; unknown fields that do not (e.g. `user`) are ignored, as OpenAI does.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field
from typing import Any

from dflash_serve.speculative.types import SamplingParams
from gateway.openai_errors import bad_request

ROLES = ("system", "user", "assistant", "tool", "developer")
# Fields we do not implement, with the value that means "not used".
UNSUPPORTED_UNLESS_DEFAULT: dict[str, Any] = {
    "n": 1,
    "best_of": 1,
    "logprobs": None,
    "top_logprobs": None,
    "tools": None,
    "functions": None,
    "response_format": None,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "repetition_penalty": 1,
    "logit_bias": None,
    "min_tokens": 0,
    "echo": False,
    "suffix": None,
    "use_beam_search": False,
    "guided_json": None,
    "guided_regex": None,
    "guided_choice": None,
}
NOT_USED = (None, False, {}, [], "none", "auto")


@dataclass(frozen=True)
class GenerationRequest:
    is_chat: bool
    model: str | None
    messages: tuple[dict, ...] = ()
    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    chat_template_kwargs: dict = field(default_factory=dict)
    max_tokens: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False


def parse_chat_request(body: Any) -> GenerationRequest:
    body = _require_object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list of messages", "messages")
    return _parse_common(body, is_chat=True, messages=tuple(_message(m) for m in messages))


def parse_completion_request(body: Any) -> GenerationRequest:
    body = _require_object(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return _parse_common(body, is_chat=False, prompt=prompt)
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return _parse_common(body, is_chat=False, prompt_ids=tuple(prompt))
    raise bad_request(
        "'prompt' must be a string or a list of token ids (one prompt per request)", "prompt"
    )


def _require_object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def _message(message: Any) -> dict:
    if not isinstance(message, dict):
        raise bad_request("each message must be an object with 'role' and 'content'", "messages")
    role = message.get("role")
    if role not in ROLES:
        raise bad_request(f"message role must be one of {list(ROLES)}, got {role!r}", "messages")
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad_request("only text content parts are supported", "messages")
            parts.append(str(part.get("text", "")))
        content = "".join(parts)
    if content is None and role == "assistant":
        content = ""
    if not isinstance(content, str):
        raise bad_request("message content must be a string or a list of text parts", "messages")
    return {"role": role, "content": content}


def _parse_common(body: dict, is_chat: bool, **fields) -> GenerationRequest:
    _refuse_unsupported(body)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", "model")
    max_tokens = _optional_int(body, "max_completion_tokens" if is_chat else "max_tokens", 1)
    if max_tokens is None:
        max_tokens = _optional_int(body, "max_tokens", 1)
    stream = _bool(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    if options and not stream:
        raise bad_request("'stream_options' is only allowed with stream=true", "stream_options")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    return GenerationRequest(
        is_chat=is_chat,
        model=model,
        chat_template_kwargs=kwargs,
        max_tokens=max_tokens,
        sampling=_sampling(body),
        stop_strings=_stop_strings(body.get("stop")),
        stop_token_ids=_int_list(body, "stop_token_ids"),
        ignore_eos=_bool(body, "ignore_eos"),
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
        **fields,
    )


def _refuse_unsupported(body: dict) -> None:
    for name, default in UNSUPPORTED_UNLESS_DEFAULT.items():
        value = body.get(name, default)
        if value != default and value not in NOT_USED:
            raise bad_request(f"'{name}' is not supported by this server (got {value!r})", name)
    choice = body.get("tool_choice")
    if choice not in (None, "none", "auto"):
        raise bad_request("'tool_choice' is not supported by this server", "tool_choice")
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") not in (None, "text"):
        raise bad_request("'response_format' other than text is not supported", "response_format")


def _sampling(body: dict) -> SamplingParams:
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise bad_request("'top_p' must be in (0, 1]", "top_p")
    top_k = _optional_int(body, "top_k", -1)
    seed = _optional_int(body, "seed", None)
    if seed is None:
        seed = secrets.randbits(63)
    elif seed < 0:
        seed %= 2**63  # negative seeds are legal in OpenAI clients; map them deterministically
    return SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=0 if top_k in (None, -1, 0) else top_k,
        seed=seed % 2**63,
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional_int(body: dict, name: str, minimum: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise bad_request(f"'{name}' must be an integer, got {value!r}", name)
    if minimum is not None and value < minimum:
        raise bad_request(f"'{name}' must be >= {minimum}, got {value}", name)
    return value


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad_request(f"'{name}' must be a number, got {value!r}", name)
    if not low <= value <= high:
        raise bad_request(f"'{name}' must be in [{low}, {high}], got {value}", name)
    return float(value)


def _bool(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be a boolean, got {value!r}", name)
    return value


def _stop_strings(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad_request("'stop' must be a string or a list of strings", "stop")
    if any(s == "" for s in stop):
        raise bad_request("'stop' strings must not be empty", "stop")
    return tuple(stop)


def _int_list(body: dict, name: str) -> tuple[int, ...]:
    value = body.get(name)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(_is_int(v) and v >= 0 for v in value):
        raise bad_request(f"'{name}' must be a list of non-negative integers", name)
    return tuple(value)
