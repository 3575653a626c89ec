"""The whole product as three processes, driven with the official `openai` client."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from transformers import AutoTokenizer

from dflash_serve.speculative.loop import SpeculativeGeneration, StopRules
from dflash_serve.speculative.types import SamplingParams
from launcher.service_processes import http
from target_service.engine import TargetEngine
from target_service.model.loader import load_target_model
from target_service.model.state import StateShape
from target_service.session import InProcessTarget
from tests.gateway_processes import start_stack

MESSAGES = [{"role": "user", "content": "Name three colours."}]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def stack(embedded_pair):
    target, drafter, gateway = start_stack(*embedded_pair)
    yield gateway
    for process in (gateway, target, drafter):
        process.stop()


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(embedded_pair):
    """The target alone, in this process: (prompt ids, sampling) → (text, tokens, finish)."""
    target_dir, _ = embedded_pair
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = load_target_model(target_dir)
    target = InProcessTarget(TargetEngine(model, StateShape(2, 512)))
    eos = frozenset(model.config.eos_token_ids)

    def run(prompt_ids, sampling, max_tokens=MAX_TOKENS):
        async def go():
            session = await target.open(sampling)
            gen = SpeculativeGeneration(
                session, None, prompt_ids, StopRules(max_tokens, eos), 15, 512
            )
            tokens = [t async for t in gen.tokens()]
            await session.close()
            return tokens, gen.finish_reason

        tokens, finish = asyncio.run(go())
        shown = [t for t in tokens if t not in eos]
        return tokenizer.decode(shown, skip_special_tokens=True), tokens, finish

    def chat_ids(messages, **kwargs):
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **kwargs
        )
        return tokenizer.encode(text, add_special_tokens=False)

    yield run, chat_ids, tokenizer
    target.close()


def test_greedy_chat_equals_the_target_alone(client, reference):
    run, chat_ids, _ = reference
    prompt = chat_ids(MESSAGES)
    text, tokens, finish = run(prompt, SamplingParams())
    response = client.chat.completions.create(
        model="dflash", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0
    )
    choice = response.choices[0]
    assert choice.message.content == text
    assert choice.finish_reason == finish
    assert response.usage.prompt_tokens == len(prompt)
    assert response.usage.completion_tokens == len(tokens)
    assert response.usage.total_tokens == len(prompt) + len(tokens)


def test_streaming_chat_with_usage_chunk(client, reference):
    run, chat_ids, _ = reference
    prompt = chat_ids(MESSAGES, enable_thinking=False)
    text, tokens, finish = run(prompt, SamplingParams())
    stream = client.chat.completions.create(
        model="dflash",
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == text
    finishing = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishing == [finish]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(tokens)
    assert chunks[-1].usage.prompt_tokens == len(prompt)


def test_seeded_sampling_equals_the_target_alone(client, reference):
    run, chat_ids, _ = reference
    for seed in (3, 12345):
        sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=seed)
        text, _, _ = run(chat_ids(MESSAGES), sampling)
        response = client.chat.completions.create(
            model="dflash",
            messages=MESSAGES,
            max_tokens=MAX_TOKENS,
            temperature=0.8,
            top_p=0.9,
            seed=seed,
        )
        assert response.choices[0].message.content == text


def test_completions_endpoint_and_stop_string(client, reference):
    run, _, tokenizer = reference
    prompt = "Once upon a time"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    text, _, _ = run(ids, SamplingParams(), max_tokens=30)
    response = client.completions.create(
        model="dflash", prompt=prompt, max_tokens=30, temperature=0
    )
    assert response.choices[0].text == text
    candidates = [
        text[i : i + 2] for i in range(3, len(text) - 2) if "\ufffd" not in text[i : i + 2]
    ]
    if candidates:
        stop = candidates[0]
        response = client.completions.create(
            model="dflash", prompt=prompt, max_tokens=30, temperature=0, stop=[stop]
        )
        assert response.choices[0].text == text[: text.index(stop)]
        assert response.choices[0].finish_reason == "stop"


def raw_post(stack, path, body: str | dict):
    content = body if isinstance(body, str) else json.dumps(body)
    return http("POST", stack.base_url + path, content.encode())


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ("{not json", None),
        ({"messages": MESSAGES, "max_tokens": -1}, "max_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": MESSAGES, "temperature": "hot"}, "temperature"),
        ({"messages": MESSAGES, "n": 2}, "n"),
        ({"messages": MESSAGES, "logprobs": True}, "logprobs"),
        ({"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools"),
        ({"messages": MESSAGES, "response_format": {"type": "json_object"}}, "response_format"),
        ({"messages": [{"role": "user", "content": "x" * 600}]}, "messages"),
        ({"messages": MESSAGES, "max_tokens": 600}, "messages"),
    ],
)
def test_bad_requests_get_openai_shaped_400s(stack, body, param):
    response = raw_post(stack, "/v1/chat/completions", body)
    assert response.status == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400 and error["message"]
    assert error["param"] == param


def test_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as error:
        client.chat.completions.create(model="gpt-9", messages=MESSAGES, max_tokens=5)
    assert "gpt-9" in error.value.message


def test_models_tokenize_health_and_metrics(stack, client, reference):
    _, chat_ids, _ = reference
    assert [m.id for m in client.models.list().data] == ["dflash"]
    tokenized = raw_post(stack, "/tokenize", {"messages": MESSAGES}).json()
    assert tokenized["tokens"] == chat_ids(MESSAGES) and tokenized["count"] == len(
        tokenized["tokens"]
    )
    assert http("GET", stack.base_url + "/health").status == 200
    metrics = http("GET", stack.base_url + "/metrics").text
    for name in (
        "vllm:spec_decode_num_drafts_total",
        "vllm:spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:request_success_total",
    ):
        assert name in metrics, name
    drafts = [
        line
        for line in metrics.splitlines()
        if line.startswith("vllm:spec_decode_num_drafts_total")
    ]
    assert float(drafts[0].split()[-1]) > 0
