"""README's run command: `dflash-serve up` with no model serves the embedded demo pair."""

from __future__ import annotations

import json
import time

import pytest

from launcher.service_processes import GATEWAY_LISTENING, http, start_service, wait_healthy

# Documentation the pair never saw (no such module exists): a right answer must be read from
# the prompt, not recalled.
INVENTED_NAME = "greenhouse.Sprinkler.water"
INVENTED_DOCUMENTATION = (
    "Water every plant in the greenhouse once, starting from the north door.\n\n"
    "Returns the number of litres used."
)


def test_up_serves_the_trained_embedded_pair():
    up = start_service(
        ["up", "--device", "cpu"], 120, wait_ready=wait_healthy, listening=GATEWAY_LISTENING
    )
    try:
        # The pair's domain: a question about documentation quoted in the prompt.
        question = (
            f"### `{INVENTED_NAME}`\n{INVENTED_DOCUMENTATION}\n\n"
            f"What does the documentation above say about `{INVENTED_NAME}`?"
        )
        body = {
            "messages": [{"role": "user", "content": question}],
            "max_tokens": 24,
            "temperature": 0,
        }
        response = http("POST", up.base_url + "/v1/chat/completions", json.dumps(body).encode())
        assert response.status == 200, response.text
        answer = response.json()["choices"][0]["message"]["content"]
        assert len(answer) >= 40, answer
        assert INVENTED_DOCUMENTATION.startswith(answer), answer
        models = http("GET", up.base_url + "/v1/models").json()
        assert models["data"][0]["id"] == "dflash"
    finally:
        up.stop()


def test_a_service_that_exits_before_listening_is_reported_at_once():
    began = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)did not start.*invalid choice"):
        start_service(["no-such-command"], timeout_s=600)
    assert time.monotonic() - began < 120  # its exit, not the 600 s timeout, ended the wait
