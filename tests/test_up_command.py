"""README's run command: `dflash-serve up` with no model serves the embedded demo pair."""

from __future__ import annotations

import json

from launcher.service_processes import GATEWAY_LISTENING, http, start_service, wait_healthy


def test_up_serves_the_embedded_pair(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    up = start_service(
        ["up", "--device", "cpu"], 120, wait_ready=wait_healthy, listening=GATEWAY_LISTENING
    )
    try:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "seed": 1}
        response = http("POST", up.base_url + "/v1/chat/completions", json.dumps(body).encode())
        assert response.status == 200, response.text
        usage = response.json()["usage"]
        assert 1 <= usage["completion_tokens"] <= 8
        assert (tmp_path / "dflash-serve" / "embedded-random-v2" / "COMPLETE").is_file()
        models = http("GET", up.base_url + "/v1/models").json()
        assert models["data"][0]["id"] == "dflash"
    finally:
        up.stop()
