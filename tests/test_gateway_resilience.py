"""What happens when a service dies, a client leaves or the server is full."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
import urllib.request

import openai
import pytest

from gateway.drafter_client import DrafterClient
from gateway.target_client import TargetClient
from launcher.service_processes import http
from tests.gateway_processes import start_gateway, start_stack

MESSAGES = [{"role": "user", "content": "Tell me a long story."}]
LONG = {"max_tokens": 200, "temperature": 0, "extra_body": {"ignore_eos": True}}


def client_for(gateway):
    return openai.OpenAI(base_url=gateway.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def fresh_stack(embedded_pair):
    processes = start_stack(*embedded_pair)
    yield processes
    for process in reversed(processes):
        process.stop()


def stream_body(**extra) -> bytes:
    body = {
        "messages": MESSAGES,
        "stream": True,
        "max_tokens": 200,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }
    return json.dumps(body).encode()


def open_stream(gateway):
    request = urllib.request.Request(
        gateway.base_url + "/v1/chat/completions",
        data=stream_body(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    return urllib.request.urlopen(request, timeout=60)


def sse_events(response):
    for raw in response:
        line = raw.decode().strip()
        if line.startswith("data: "):
            yield line.removeprefix("data: ")


def test_drafter_killed_mid_stream_gives_identical_output(fresh_stack):
    _target, drafter, gateway = fresh_stack
    client = client_for(gateway)
    expected = client.chat.completions.create(model="dflash", messages=MESSAGES, **LONG)
    stream = client.chat.completions.create(model="dflash", messages=MESSAGES, stream=True, **LONG)
    pieces, num_after_kill = [], 0
    for index, chunk in enumerate(stream):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        num_after_kill += index > 5
        if index == 5:
            drafter.process.send_signal(signal.SIGKILL)
    assert num_after_kill >= 10  # (chunks are steps: the kill came well before the end)
    assert "".join(pieces) == expected.choices[0].message.content
    assert http("GET", gateway.base_url + "/health").status == 503
    again = client.chat.completions.create(model="dflash", messages=MESSAGES, **LONG)
    assert again.choices[0].message.content == expected.choices[0].message.content


def test_target_killed_mid_stream_ends_with_an_error_event_and_done(fresh_stack):
    target, _drafter, gateway = fresh_stack
    events = []
    with open_stream(gateway) as response:
        for event in sse_events(response):
            events.append(event)
            if len(events) == 3:
                target.process.send_signal(signal.SIGKILL)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 503 and "target" in error["message"]
    with pytest.raises(openai.APIStatusError) as failure:
        client_for(gateway).chat.completions.create(model="dflash", messages=MESSAGES, max_tokens=5)
    assert failure.value.status_code == 503


async def active_sessions(target_address, drafter_address) -> tuple[int, int]:
    target, drafter = TargetClient(target_address), DrafterClient(drafter_address)
    try:
        t, d = await target.stats(), await drafter.stats()
        return t["num_active_sessions"], d["num_active_sessions"]
    finally:
        await target.close()
        await drafter.close()


def test_client_disconnect_frees_both_sessions(fresh_stack):
    target, drafter, gateway = fresh_stack
    with open_stream(gateway) as response:
        events = sse_events(response)
        next(events)
        next(events)
        assert asyncio.run(active_sessions(target.address, drafter.address)) == (1, 1)
    deadline = time.monotonic() + 10
    while (counts := asyncio.run(active_sessions(target.address, drafter.address))) != (0, 0):
        assert time.monotonic() < deadline, counts
        time.sleep(0.1)


def test_full_queue_answers_503_with_retry_after(fresh_stack):
    target, drafter, _ = fresh_stack
    gateway = start_gateway(
        target.address,
        drafter.address,
        _tokenizer_dir(target),
        "--max-concurrent-requests",
        "1",
        "--max-queued-requests",
        "0",
    )
    try:
        results = {}

        def long_request():
            with open_stream(gateway) as response:
                results["first"] = list(sse_events(response))[-1]

        worker = threading.Thread(target=long_request)
        worker.start()
        time.sleep(1.0)
        second = http(
            "POST",
            gateway.base_url + "/v1/chat/completions",
            json.dumps({"messages": MESSAGES, "max_tokens": 3}).encode(),
        )
        worker.join(60)
        assert second.status == 503
        assert second.headers.get("Retry-After") == "1"
        assert second.json()["error"]["code"] == 503
        assert results["first"] == "[DONE]"
    finally:
        gateway.stop()


def _tokenizer_dir(target) -> str:
    """The target's checkpoint directory, from its command line."""
    args = target.process.args
    return args[args.index("--model") + 1]
