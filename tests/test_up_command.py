"""README's run command: `dflash-serve up` with no model serves the embedded demo pair."""

from __future__ import annotations

import inspect
import json
import textwrap

from launcher.service_processes import GATEWAY_LISTENING, http, start_service, wait_healthy


def test_up_serves_the_trained_embedded_pair():
    up = start_service(
        ["up", "--device", "cpu"], 120, wait_ready=wait_healthy, listening=GATEWAY_LISTENING
    )
    try:
        # A question from the pair's training data: its answer is CPython's own docstring.
        question = "How do I use `textwrap.dedent`?"
        body = {
            "messages": [{"role": "user", "content": question}],
            "max_tokens": 24,
            "temperature": 0,
        }
        response = http("POST", up.base_url + "/v1/chat/completions", json.dumps(body).encode())
        assert response.status == 200, response.text
        answer = response.json()["choices"][0]["message"]["content"]
        first_line = inspect.getdoc(textwrap.dedent).splitlines()[0]
        assert answer.startswith(first_line[:40]), answer
        models = http("GET", up.base_url + "/v1/models").json()
        assert models["data"][0]["id"] == "dflash"
    finally:
        up.stop()
