"""Core `GenerateChunk`s → Anthropic `message` objects and the Messages streaming event sequence.

Stream contract (Anthropic's): `message_start`, then for each content block `content_block_start`,
its deltas (`thinking_delta`, `text_delta` or `input_json_delta`) and `content_block_stop`, then
`message_delta` (stop_reason, usage) and `message_stop`; an error after the stream began is an
`error` event. Thinking text (core's `reasoning`) becomes `thinking` blocks, tool calls
`tool_use` blocks. Core reports the prompt's token count on its first chunk, which
the gateway reads before it sends `message_start`.
"""

from __future__ import annotations

import json
from typing import Any

from services.gateway.chat_format import tool_call_id
from services.gateway.errors import OpenAIError
from services.gateway.generation_state import CompletionMeta, GenerationState, sse_named
from services.proto.moemesh.v1 import core_pb2

STOP_REASONS: dict[int, str] = {
    core_pb2.STOP: "end_turn",
    core_pb2.LENGTH: "max_tokens",
    core_pb2.TOOL_CALLS: "tool_use",
    core_pb2.CANCELLED: "end_turn",
}


def tool_input(arguments: str) -> dict[str, Any]:
    """Tool call arguments as the object Anthropic's `input` must be; core's parser produces JSON
    objects, anything else is kept under one key rather than dropped."""
    try:
        parsed = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        return {"arguments": arguments}
    return parsed if isinstance(parsed, dict) else {"arguments": parsed}


def input_usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict[str, int]:
    """Anthropic's usage counters. Its three input counters are disjoint (the prompt is their
    sum): `input_tokens` counts only what was computed, the prefix-cache hits go under
    `cache_read_input_tokens`."""
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached_tokens,
    }


class AnthropicFormatter:
    """Renders one Anthropic message, streamed or whole."""

    log_event = "messages"

    def __init__(self, meta: CompletionMeta) -> None:
        self.meta = meta
        self.state = GenerationState()
        self._open_block: str | None = None  # "thinking" | "text" while a block is open
        self._index = -1

    def _usage(self) -> dict[str, int]:
        return input_usage(
            self.state.prompt_tokens, self.state.cached_prompt_tokens, self.state.completion_tokens
        )

    def _stop(self) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) once the stream has ended."""
        if self.state.finish_reason == core_pb2.STOP and self.state.matched_stop:
            return "stop_sequence", self.state.matched_stop
        return STOP_REASONS.get(self.state.finish_reason or 0, "end_turn"), None

    def _message(self, content: list[dict[str, Any]], stop_reason: str | None) -> dict[str, Any]:
        return {
            "id": self.meta.id,
            "type": "message",
            "role": "assistant",
            "model": self.meta.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": self._stop()[1] if stop_reason else None,
            "usage": self._usage(),
        }

    def result(self) -> dict[str, Any]:
        state = self.state
        state.require_finished()
        content: list[dict[str, Any]] = []
        if state.reasoning:
            content.append({"type": "thinking", "thinking": state.full_reasoning(), "signature": ""})
        if state.text or not state.tool_calls:
            content.append({"type": "text", "text": state.full_text()})
        content.extend(
            {
                "type": "tool_use",
                "id": tool_call_id(call),
                "name": call.name,
                "input": tool_input(call.arguments),
            }
            for call in state.tool_calls
        )
        return self._message(content, self._stop()[0])

    def opening(self, first: core_pb2.GenerateChunk) -> list[bytes]:
        start = self._message([], None)
        # Core puts the prompt's token counts on its first chunk (and again on the last).
        start["usage"] = input_usage(first.usage.prompt_tokens, first.usage.cached_prompt_tokens, 0)
        return [sse_named("message_start", {"type": "message_start", "message": start})]

    def on_chunk(self, chunk: core_pb2.GenerateChunk) -> list[bytes]:
        out: list[bytes] = []
        if chunk.reasoning:
            out += self._ensure_block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": chunk.reasoning}))
        if chunk.text:
            out += self._ensure_block("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": chunk.text}))
        for call in chunk.tool_calls:
            out += self._close_block()
            block = {"type": "tool_use", "id": tool_call_id(call), "name": call.name, "input": {}}
            out += self._start_block(block)
            arguments = json.dumps(tool_input(call.arguments))
            out.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
            out += self._close_block()
        if chunk.finish_reason != core_pb2.FINISH_REASON_UNSPECIFIED:
            if self._index < 0:  # no content at all: Anthropic still sends one (empty) text block
                out += self._ensure_block("text", {"type": "text", "text": ""})
            out += self._close_block()
            out.append(
                sse_named(
                    "message_delta",
                    {
                        "type": "message_delta",
                        "delta": dict(zip(("stop_reason", "stop_sequence"), self._stop(), strict=True)),
                        "usage": self._usage(),
                    },
                )
            )
        return out

    def closing(self) -> list[bytes]:
        self.state.require_finished()
        return [sse_named("message_stop", {"type": "message_stop"})]

    def error_event(self, error: OpenAIError) -> bytes:
        return sse_named("error", error.anthropic_body())

    def _ensure_block(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        if self._open_block == kind:
            return []
        return self._close_block() + self._start_block(block)

    def _start_block(self, block: dict[str, Any]) -> list[bytes]:
        self._index += 1
        self._open_block = block["type"]
        return [
            sse_named(
                "content_block_start",
                {"type": "content_block_start", "index": self._index, "content_block": block},
            )
        ]

    def _close_block(self) -> list[bytes]:
        if self._open_block is None:
            return []
        self._open_block = None
        return [sse_named("content_block_stop", {"type": "content_block_stop", "index": self._index})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse_named(
            "content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta}
        )
