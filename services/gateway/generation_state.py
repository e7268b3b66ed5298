"""What one `Core.Generate` stream has produced so far, and the SSE framing every API shares.

Pure data, no I/O: the chat, completions and Anthropic formatters all read the same accumulator,
so usage, finish reasons and tool calls are counted one way for every API.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from services.proto.moemesh.v1 import core_pb2


class MissingFinishReason(Exception):
    """Core ended a Generate stream with OK but never sent a finish reason: a core bug, reported as
    a 500 rather than guessed, so it is found instead of hidden."""


@dataclass(frozen=True)
class CompletionMeta:
    """What every object of one response shares."""

    id: str
    created: int
    model: str


@dataclass
class GenerationState:
    """Everything seen so far on one Generate stream (used by both response modes)."""

    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: list[core_pb2.ToolCall] = field(default_factory=list)
    logprobs: list[core_pb2.TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[core_pb2.TokenLogprob] = field(
        default_factory=list
    )  # asked for: on the first chunk
    finish_reason: int | None = None  # core_pb2.FinishReason once the stream has ended
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    matched_stop: str = ""  # the stop string that ended generation, when core names it
    queue_seconds: float | None = None
    prefill_seconds: float | None = None
    _counted_tokens: int = 0

    def add(self, chunk: core_pb2.GenerateChunk) -> None:
        # Runs once per token on the streaming path: only the cheap checks for ordinary chunks.
        if chunk.text:
            self.text.append(chunk.text)
        if chunk.reasoning:
            self.reasoning.append(chunk.reasoning)
        if chunk.tool_calls:
            self.tool_calls.extend(chunk.tool_calls)
        if chunk.logprobs:
            self.logprobs.extend(chunk.logprobs)
        if chunk.prompt_logprobs:
            self.prompt_logprobs.extend(chunk.prompt_logprobs)
        self._counted_tokens += len(chunk.token_ids)
        self.completion_tokens = self._counted_tokens
        if not chunk.finish_reason:
            return  # usage and timings come with the finish reason, on the last chunk
        if chunk.HasField("usage"):
            self.prompt_tokens = chunk.usage.prompt_tokens
            self.completion_tokens = chunk.usage.completion_tokens
            self.cached_prompt_tokens = chunk.usage.cached_prompt_tokens
        if chunk.HasField("timings"):
            self.queue_seconds = chunk.timings.queue_seconds
            self.prefill_seconds = chunk.timings.prefill_seconds
        self.finish_reason = chunk.finish_reason
        self.matched_stop = chunk.matched_stop

    def require_finished(self) -> int:
        if self.finish_reason is None:
            raise MissingFinishReason("core ended the stream without a finish reason")
        return self.finish_reason

    def full_text(self) -> str:
        return "".join(self.text)

    def full_reasoning(self) -> str:
        return "".join(self.reasoning)


def sse_data(data: dict[str, Any] | str) -> bytes:
    """One server-sent event frame: `data: <json>\\n\\n` (or a literal such as `[DONE]`)."""
    payload = data if isinstance(data, str) else to_json(data)
    return f"data: {payload}\n\n".encode()


def sse_named(event: str, data: dict[str, Any]) -> bytes:
    """A frame with an event name, as Anthropic's streams use: `event: x\\ndata: {...}\\n\\n`."""
    return f"event: {event}\ndata: {to_json(data)}\n\n".encode()


_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))  # one, not one per call


def to_json(data: Any) -> str:
    return _ENCODER.encode(data)
