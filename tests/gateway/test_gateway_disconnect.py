"""A client that goes away must cancel the core call, so core frees the sequence and its KV cache."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from .core_double import MODEL_ID, CoreDouble

CHAT = "/v1/chat/completions"
BODY = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}]}
SLOW_WORDS = [f" w{i}" for i in range(200)]


def test_disconnect_mid_stream_cancels_core_call(gateway_url: str, core: CoreDouble) -> None:
    core.script.words = SLOW_WORDS
    core.script.delay_per_chunk_s = 0.05  # 10 s in all: far longer than the test waits
    contents: list[str] = []
    with (
        httpx.Client(timeout=10) as client,
        client.stream("POST", gateway_url + CHAT, json={**BODY, "stream": True}) as response,
    ):
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                delta = json.loads(line.removeprefix("data: "))["choices"][0]["delta"]
                if delta.get("content"):
                    contents.append(delta["content"])
            if len(contents) == 2:
                break  # leaving the block closes the connection mid-stream
    assert contents == SLOW_WORDS[:2]
    assert core.cancelled.wait(5), "core's Generate context was not cancelled"


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_before_first_token_cancels_core_call(
    gateway_url: str, core: CoreDouble, stream: bool
) -> None:
    # Long prefill or a queue: nothing is sent yet, so only the watcher on the connection notices.
    core.script.delay_before_first_s = 10.0
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gateway_url + CHAT, json={**BODY, "stream": stream}, timeout=httpx.Timeout(10, read=0.5))
    assert core.generate_started.is_set()
    assert core.cancelled.wait(5), "core's Generate context was not cancelled"


def test_gateway_keeps_serving_after_disconnects(gateway_url: str, core: CoreDouble) -> None:
    core.script.delay_before_first_s = 10.0
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gateway_url + CHAT, json=BODY, timeout=httpx.Timeout(10, read=0.3))
    assert core.cancelled.wait(5)
    core.reset()
    response = httpx.post(gateway_url + CHAT, json=BODY)
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "stop"


def test_disconnect_cancels_every_call_of_a_batch_of_prompts(gateway_url: str, core: CoreDouble) -> None:
    core.script.delay_before_first_s = 10.0
    body = {"model": BODY["model"], "prompt": ["a", "b", "c"], "max_tokens": 4}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gateway_url + "/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.5))
    deadline = time.monotonic() + 5
    while core.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(core.requests) == 3 and core.running == 0  # all three cancelled, none left running


def test_disconnect_mid_stream_cancels_every_choice(gateway_url: str, core: CoreDouble) -> None:
    core.script.words = SLOW_WORDS
    core.script.delay_per_chunk_s = 0.05
    body = {**BODY, "n": 3, "stream": True}
    seen = 0
    with httpx.Client(timeout=10) as client, client.stream("POST", gateway_url + CHAT, json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            seen += line.startswith("data: ")
            if seen == 6:
                break  # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 5
    while core.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(core.requests) == 3 and core.running == 0
