"""Core `GenerateChunk`s → OpenAI `chat.completion` / `chat.completion.chunk` JSON and SSE frames.

The shapes follow OpenAI's documented objects. Where OpenAI has no field we use vLLM's, so client
code written for vLLM already knows it: `reasoning_content` for thinking text, finish reason
"abort" for `FinishReason.CANCELLED`. Core sends each tool call whole; it is streamed the way
OpenAI streams one (a delta with index, id, type and function name, then the arguments), which is
what `openai`'s stream helpers and LangChain-style accumulators merge by index.
"""

from __future__ import annotations

import uuid
from typing import Any

from services.gateway.errors import OpenAIError
from services.gateway.generation_state import CompletionMeta, GenerationState, sse_data, to_json
from services.proto.moemesh.v1 import core_pb2

FINISH_REASON_NAMES: dict[int, str] = {
    core_pb2.STOP: "stop",
    core_pb2.LENGTH: "length",
    core_pb2.TOOL_CALLS: "tool_calls",
    core_pb2.CANCELLED: "abort",
}


def finish_reason_name(reason: int) -> str:
    return FINISH_REASON_NAMES.get(reason, "stop")


def tool_call_id(call: core_pb2.ToolCall) -> str:
    return call.id or f"call_{uuid.uuid4().hex[:24]}"


def token_bytes(item: core_pb2.TokenLogprob | core_pb2.TopLogprob) -> bytes:
    """The token's own UTF-8 bytes (part of a character, maybe: clients join them), from core; a
    core that does not send them: the bytes of its decoded text."""
    return item.token_bytes or item.token.encode("utf-8")


def logprobs_json(logprobs: list[core_pb2.TokenLogprob]) -> list[dict[str, Any]]:
    return [
        {
            "token": item.token,
            "logprob": item.logprob,
            "bytes": list(token_bytes(item)),
            "top_logprobs": [
                {"token": top.token, "logprob": top.logprob, "bytes": list(token_bytes(top))}
                for top in item.top
            ],
        }
        for item in logprobs
    ]


def usage_json(state: GenerationState) -> dict[str, Any]:
    return {
        "prompt_tokens": state.prompt_tokens,
        "completion_tokens": state.completion_tokens,
        "total_tokens": state.prompt_tokens + state.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": state.cached_prompt_tokens},
    }


class ChatFormatter:
    """Renders one chat completion, streamed or whole, from the shared `GenerationState`."""

    log_event = "chat completion"

    def __init__(
        self, meta: CompletionMeta, *, include_usage: bool, with_logprobs: bool, index: int = 0
    ) -> None:
        """`index`: the choice this call's answer is (n > 1 makes one call per choice)."""
        self.meta = meta
        self.index = index
        self.state = GenerationState()
        self.include_usage = include_usage
        self.with_logprobs = with_logprobs
        # A content-only chunk rendered once around a marker, split into the bytes before and after.
        marker = "\u0000text\u0000"
        frame = sse_data(self._chunk({"content": marker}))
        before, found, after = frame.partition(to_json(marker).encode())
        self._content_frame: tuple[bytes, bytes] | None = (before, after) if found else None

    # -- whole response -------------------------------------------------------------------------
    def result(self) -> dict[str, Any]:
        state = self.state
        finish = state.require_finished()
        content = state.full_text()
        message: dict[str, Any] = {
            "role": "assistant",
            "content": content if content or not state.tool_calls else None,
        }
        if state.reasoning:
            message["reasoning_content"] = state.full_reasoning()
        if state.tool_calls:
            message["tool_calls"] = [
                {
                    "id": tool_call_id(call),
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in state.tool_calls
            ]
        return {
            "id": self.meta.id,
            "object": "chat.completion",
            "created": self.meta.created,
            "model": self.meta.model,
            "choices": [
                {
                    "index": self.index,
                    "message": message,
                    "logprobs": {"content": logprobs_json(state.logprobs)} if self.with_logprobs else None,
                    "finish_reason": finish_reason_name(finish),
                }
            ],
            "usage": usage_json(state),
        }

    # -- stream -----------------------------------------------------------------------------------
    def opening(self, first: core_pb2.GenerateChunk) -> list[bytes]:
        return [sse_data(self._chunk({"role": "assistant", "content": ""}))]

    def on_chunk(self, chunk: core_pb2.GenerateChunk) -> list[bytes]:
        """The frames for one core chunk; `self.state` already includes it. A finish reason gets
        its own chunk with an empty delta, which is what OpenAI sends and clients look for."""
        if self._content_frame is not None and not (
            chunk.finish_reason or chunk.logprobs or chunk.tool_calls or chunk.reasoning
        ):
            # The common case, once per token: only the text changes between frames.
            if not chunk.text:
                return []
            prefix, suffix = self._content_frame
            return [prefix + to_json(chunk.text).encode() + suffix]
        out: list[bytes] = []
        if chunk.reasoning:
            out.append(sse_data(self._chunk({"reasoning_content": chunk.reasoning})))
        logprobs = list(chunk.logprobs)
        if chunk.text or logprobs:
            out.append(sse_data(self._chunk({"content": chunk.text}, logprobs=logprobs)))
        first_index = len(self.state.tool_calls) - len(chunk.tool_calls)
        for offset, call in enumerate(chunk.tool_calls):
            index = first_index + offset
            head = {
                "index": index,
                "id": tool_call_id(call),
                "type": "function",
                "function": {"name": call.name, "arguments": ""},
            }
            out.append(sse_data(self._chunk({"tool_calls": [head]})))
            if call.arguments:
                arguments = {"index": index, "function": {"arguments": call.arguments}}
                out.append(sse_data(self._chunk({"tool_calls": [arguments]})))
        if chunk.finish_reason != core_pb2.FINISH_REASON_UNSPECIFIED:
            out.append(sse_data(self._chunk({}, finish_reason=finish_reason_name(chunk.finish_reason))))
        return out

    def closing(self, usage: dict[str, Any] | None = None) -> list[bytes]:
        """The last frames; `usage`: the whole answer's, where it has more choices than this one."""
        self.state.require_finished()
        out = []
        if self.include_usage:  # an extra last chunk with no choices, only usage
            out.append(
                sse_data(
                    {
                        "id": self.meta.id,
                        "object": "chat.completion.chunk",
                        "created": self.meta.created,
                        "model": self.meta.model,
                        "choices": [],
                        "usage": usage or usage_json(self.state),
                    }
                )
            )
        out.append(sse_data("[DONE]"))
        return out

    def error_event(self, error: OpenAIError) -> bytes:
        return sse_data(error.body())

    def _chunk(
        self,
        delta: dict[str, Any],
        *,
        finish_reason: str | None = None,
        logprobs: list[core_pb2.TokenLogprob] | None = None,
    ) -> dict[str, Any]:
        """One `chat.completion.chunk`; `usage: null` is present only when the client asked for a
        usage chunk, as OpenAI does."""
        result: dict[str, Any] = {
            "id": self.meta.id,
            "object": "chat.completion.chunk",
            "created": self.meta.created,
            "model": self.meta.model,
            "choices": [
                {
                    "index": self.index,
                    "delta": delta,
                    "logprobs": {"content": logprobs_json(logprobs)} if logprobs else None,
                    "finish_reason": finish_reason,
                }
            ],
        }
        if self.include_usage:
            result["usage"] = None
        return result
