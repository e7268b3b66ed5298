"""Core `GenerateChunk`s → OpenAI `chat.completion` / `chat.completion.chunk` JSON and SSE frames.

Pure functions and one accumulator, no I/O, so the wire format can be tested without sockets.
The shapes follow OpenAI's documented objects; where OpenAI has no value for a core state
(`FinishReason.CANCELLED`) we use vLLM's ("abort") so existing client code already knows it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from services.proto.moemesh.v1 import core_pb2

FINISH_REASON_NAMES: dict[int, str] = {
    core_pb2.STOP: "stop",
    core_pb2.LENGTH: "length",
    core_pb2.TOOL_CALLS: "tool_calls",
    core_pb2.CANCELLED: "abort",
}


class MissingFinishReason(Exception):
    """Core ended a Generate stream with OK but never sent a finish reason: a core bug, reported as
    a 500 rather than guessed, so it is found instead of hidden."""


@dataclass(frozen=True)
class CompletionMeta:
    """What every object of one completion shares."""

    id: str
    created: int
    model: str


def tool_call_json(call: core_pb2.ToolCall, index: int | None = None) -> dict[str, Any]:
    result: dict[str, Any] = {
        "id": call.id or f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
    if index is not None:  # stream deltas are merged by index on the client
        result = {"index": index, **result}
    return result


def logprobs_json(logprobs: list[core_pb2.TokenLogprob]) -> list[dict[str, Any]]:
    return [
        {
            "token": item.token,
            "logprob": item.logprob,
            "bytes": list(item.token.encode("utf-8")),
            "top_logprobs": [
                {"token": top.token, "logprob": top.logprob, "bytes": list(top.token.encode("utf-8"))}
                for top in item.top
            ],
        }
        for item in logprobs
    ]


def usage_json(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass
class CompletionState:
    """Everything seen so far on one Generate stream (used by both response modes)."""

    text: list[str] = field(default_factory=list)
    tool_calls: list[core_pb2.ToolCall] = field(default_factory=list)
    logprobs: list[core_pb2.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    _counted_tokens: int = 0

    def add(self, chunk: core_pb2.GenerateChunk) -> None:
        if chunk.text:
            self.text.append(chunk.text)
        self.tool_calls.extend(chunk.tool_calls)
        self.logprobs.extend(chunk.logprobs)
        self._counted_tokens += len(chunk.token_ids)
        self.completion_tokens = self._counted_tokens
        if chunk.HasField("usage"):
            self.prompt_tokens = chunk.usage.prompt_tokens
            self.completion_tokens = chunk.usage.completion_tokens
        if chunk.finish_reason != core_pb2.FINISH_REASON_UNSPECIFIED:
            self.finish_reason = FINISH_REASON_NAMES.get(chunk.finish_reason, "stop")

    def usage(self) -> dict[str, int]:
        return usage_json(self.prompt_tokens, self.completion_tokens)

    def completion(self, meta: CompletionMeta, *, with_logprobs: bool) -> dict[str, Any]:
        """The non-streaming `chat.completion` object."""
        if self.finish_reason is None:
            raise MissingFinishReason("core ended the stream without a finish reason")
        content = "".join(self.text)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": content if content or not self.tool_calls else None,
        }
        if self.tool_calls:
            message["tool_calls"] = [tool_call_json(call) for call in self.tool_calls]
        return {
            "id": meta.id,
            "object": "chat.completion",
            "created": meta.created,
            "model": meta.model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": {"content": logprobs_json(self.logprobs)} if with_logprobs else None,
                    "finish_reason": self.finish_reason,
                }
            ],
            "usage": self.usage(),
        }


def chunk_json(
    meta: CompletionMeta,
    delta: dict[str, Any],
    *,
    finish_reason: str | None = None,
    logprobs: list[core_pb2.TokenLogprob] | None = None,
    include_usage: bool = False,
) -> dict[str, Any]:
    """One `chat.completion.chunk` with a single choice; `usage: null` is present only when the
    client asked for a usage chunk, as OpenAI does."""
    result: dict[str, Any] = {
        "id": meta.id,
        "object": "chat.completion.chunk",
        "created": meta.created,
        "model": meta.model,
        "choices": [
            {
                "index": 0,
                "delta": delta,
                "logprobs": {"content": logprobs_json(logprobs)} if logprobs else None,
                "finish_reason": finish_reason,
            }
        ],
    }
    if include_usage:
        result["usage"] = None
    return result


def usage_chunk_json(meta: CompletionMeta, usage: dict[str, int]) -> dict[str, Any]:
    """The extra last chunk for `stream_options.include_usage`: no choices, only usage."""
    return {
        "id": meta.id,
        "object": "chat.completion.chunk",
        "created": meta.created,
        "model": meta.model,
        "choices": [],
        "usage": usage,
    }


def stream_chunks(
    meta: CompletionMeta, chunk: core_pb2.GenerateChunk, state: CompletionState, *, include_usage: bool
) -> list[dict[str, Any]]:
    """The OpenAI chunks for one core chunk; `state` must already include `chunk`.

    Text and tool calls go out as deltas; a finish reason gets its own chunk with an empty delta,
    which is what OpenAI sends and what clients look for to end a message.
    """
    out: list[dict[str, Any]] = []
    logprobs = list(chunk.logprobs)
    if chunk.text or logprobs:
        out.append(chunk_json(meta, {"content": chunk.text}, logprobs=logprobs, include_usage=include_usage))
    if chunk.tool_calls:
        first_index = len(state.tool_calls) - len(chunk.tool_calls)
        deltas = [tool_call_json(call, first_index + i) for i, call in enumerate(chunk.tool_calls)]
        out.append(chunk_json(meta, {"tool_calls": deltas}, include_usage=include_usage))
    if chunk.finish_reason != core_pb2.FINISH_REASON_UNSPECIFIED:
        out.append(chunk_json(meta, {}, finish_reason=state.finish_reason, include_usage=include_usage))
    return out


def sse_event(data: dict[str, Any] | str) -> bytes:
    """One server-sent event frame: `data: <json>\\n\\n` (or a literal such as `[DONE]`)."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()
