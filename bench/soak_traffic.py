"""The soak's clients: a mix of what OpenAI and Anthropic tools send, each request's outcome and
timings recorded. Used by bench/soak.py and tests/e2e/test_soak.py."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

WORDS = ["river", "stone", "Paris", "code", "light", "table", "seven", "north", "green", "write"]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
# kind -> weight in the mix
KINDS = {
    "chat": 3,
    "chat_stream": 4,
    "completions": 2,
    "completions_stream": 2,
    "messages": 2,
    "messages_stream": 2,
    "tools": 1,
    "json_schema": 1,
    "long_prompt": 1,
    "cancel": 1,
    "disconnect": 2,
}
EXPECTED = {"ok", "429", "cancelled"}  # any other outcome is an error


@dataclass
class Outcome:
    kind: str
    outcome: str  # "ok", "429", "cancelled", or the error: an HTTP status or an exception's name
    seconds: float
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    detail: str = ""
    started_at: float = 0.0  # time.monotonic()


def words(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def request_for(kind: str, rng: random.Random, model: str) -> tuple[str, dict, bool]:
    """(path, body, stream) of one request of `kind`."""
    max_tokens = rng.randint(4, 40)
    chat = {
        "model": model,
        "messages": [{"role": "user", "content": words(rng, 3, 60)}],
        "max_tokens": max_tokens,
    }
    if kind in ("chat", "chat_stream", "cancel", "disconnect"):
        stream = kind != "chat"
        return "/v1/chat/completions", {**chat, "stream": stream}, stream
    if kind.startswith("completions"):
        stream = kind.endswith("stream")
        body = {"model": model, "prompt": words(rng, 3, 60), "max_tokens": max_tokens, "stream": stream}
        return "/v1/completions", body, stream
    if kind.startswith("messages"):
        stream = kind.endswith("stream")
        return "/v1/messages", {**chat, "stream": stream}, stream
    if kind == "tools":  # the demo model has no tool-call format: it takes tools with "none" only
        body = {
            **chat,
            "tools": TOOLS,
            "tool_choice": "none" if model == "demo" else "auto",
            "max_tokens": 60,
        }
        return "/v1/chat/completions", body, False
    if kind == "json_schema":
        schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
        return "/v1/chat/completions", {**chat, "response_format": schema, "max_tokens": 60}, False
    if kind == "long_prompt":
        long = {"role": "user", "content": words(rng, 600, 900)}
        return "/v1/chat/completions", {**chat, "messages": [long], "max_tokens": 8}, False
    raise ValueError(kind)


async def one_request(client: httpx.AsyncClient, kind: str, rng: random.Random, model: str) -> Outcome:
    outcome = await _one_request(client, kind, rng, model)
    outcome.started_at = time.monotonic() - outcome.seconds
    return outcome


async def _one_request(client: httpx.AsyncClient, kind: str, rng: random.Random, model: str) -> Outcome:
    path, body, stream = request_for(kind, rng, model)
    started = time.perf_counter()
    try:
        if not stream:
            reply = await client.post(path, json=body)
            outcome = _judge_body(kind, reply)
            return Outcome(kind, outcome[0], time.perf_counter() - started, detail=outcome[1])
        cut_after = (
            rng.randint(1, 3) if kind == "cancel" else rng.randint(1, 12) if kind == "disconnect" else None
        )
        ttft, last, gaps, lines = None, None, [], 0
        async with client.stream("POST", path, json=body) as reply:
            if reply.status_code != 200:
                await reply.aread()
                return Outcome(
                    kind, _status(reply.status_code), time.perf_counter() - started, detail=reply.text[:200]
                )
            async for line in reply.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - started
                else:
                    gaps.append(now - last)
                last, lines = now, lines + 1
                if cut_after is not None and lines >= cut_after:
                    return Outcome(kind, "cancelled", now - started, ttft, gaps)  # the client goes away
        return Outcome(kind, "ok", time.perf_counter() - started, ttft, gaps)
    except httpx.HTTPError as error:
        return Outcome(kind, type(error).__name__, time.perf_counter() - started, detail=str(error)[:200])


def _status(code: int) -> str:
    return "429" if code == 429 else f"http_{code}"


def _judge_body(kind: str, reply: httpx.Response) -> tuple[str, str]:
    """("ok", "") for a well-formed answer of its kind; the error otherwise."""
    if reply.status_code != 200:
        return _status(reply.status_code), reply.text[:200]
    try:
        data = reply.json()
        if kind.startswith("messages"):
            return ("ok", "") if data["content"] is not None else ("bad_body", reply.text[:200])
        choice = data["choices"][0]
        if kind == "tools" and not (choice["message"].get("tool_calls") or "content" in choice["message"]):
            return "bad_message", reply.text[:200]
        if kind == "json_schema" and choice["finish_reason"] == "stop":
            json.loads(choice["message"]["content"])
    except (ValueError, KeyError, IndexError, TypeError) as error:
        return "bad_body", f"{type(error).__name__}: {reply.text[:200]}"
    return "ok", ""


async def client_loop(url: str, model: str, stop_at: float, seed: int, outcomes: list[Outcome]) -> None:
    rng = random.Random(seed)
    kinds, weights = list(KINDS), list(KINDS.values())
    # the openai SDK's default timeout: a long prompt beside many streams waits its turn on a slow machine
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600, connect=10)) as client:
        while time.monotonic() < stop_at:
            outcomes.append(await one_request(client, rng.choices(kinds, weights)[0], rng, model))


async def run_clients(url: str, model: str, clients: int, seconds: float, seed: int = 0) -> list[Outcome]:
    outcomes: list[Outcome] = []
    stop_at = time.monotonic() + seconds
    await asyncio.gather(
        *(client_loop(url, model, stop_at, seed * 1000 + i, outcomes) for i in range(clients))
    )
    return outcomes
