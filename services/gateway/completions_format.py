"""Core `GenerateChunk`s → OpenAI `text_completion` objects (whole or as SSE chunks).

Completions logprobs use the legacy shape: parallel lists `tokens`, `token_logprobs`,
`top_logprobs` (one {token: logprob} map per token: the most likely and the chosen one) and
`text_offset` (each token's character offset in the returned text, which starts with the prompt when
`echo` is set; core sends the echoed prompt as the first chunk's text). With echo, the prompt's own tokens come first, scored by core
(`prompt_logprobs`); the first has no context, so its logprob and alternatives are null.
"""

from __future__ import annotations

import codecs
from typing import Any

from services.gateway.chat_format import finish_reason_name, token_bytes, usage_json
from services.gateway.errors import OpenAIError
from services.gateway.generation_state import CompletionMeta, GenerationState, sse_data
from services.proto.moemesh.v1 import core_pb2


class LegacyLogprobs:
    """Accumulates the four parallel lists of the completions `logprobs` object."""

    def __init__(self) -> None:
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []
        # characters each token completes, from its bytes: a token holding part of a character
        # completes none (or the one it ends), whatever its lone decoding shows
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def characters(self, items: list[core_pb2.TokenLogprob]) -> list[int]:
        """How many characters of text each of `items` adds, in order (call once per item)."""
        return [len(self._utf8.decode(token_bytes(item))) for item in items]

    def add(
        self,
        items: list[core_pb2.TokenLogprob],
        end: int,
        characters: list[int],
        *,
        floor: int,
        prompt: bool = False,
    ) -> dict[str, Any]:
        """Record `items`, whose text ends at character `end` and adds `characters` each
        (`characters()`); returns just their part. Offsets are counted back from `end` and never
        fall below `floor`: a token's bytes may hold text the returned text lacks (SentencePiece's
        leading space, a BOS token shown as nothing). `prompt`: the items are the prompt's."""
        part = LegacyLogprobs()
        remaining = sum(characters)
        for index, (item, count) in enumerate(zip(items, characters, strict=True)):
            part.tokens.append(item.token)
            unscored = prompt and index == 0  # nothing comes before the prompt's first token
            part.token_logprobs.append(None if unscored else item.logprob)
            part.top_logprobs.append(None if unscored else _with_chosen(item))
            part.text_offset.append(max(end - remaining, floor))
            remaining -= count
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(self, name).extend(getattr(part, name))
        return part.json()

    def json(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


def _with_chosen(item: core_pb2.TokenLogprob) -> dict[str, float]:
    """The `logprobs` most likely tokens and, as OpenAI's legacy API always returns it, the chosen
    one: up to logprobs + 1 entries (so `logprobs: 0` gives the chosen token alone, not {})."""
    top = {entry.token: entry.logprob for entry in item.top}
    top.setdefault(item.token, item.logprob)
    return top


class CompletionFormatter:
    """Renders one text completion, streamed or whole."""

    log_event = "text completion"

    def __init__(
        self, meta: CompletionMeta, *, include_usage: bool, with_logprobs: bool, index: int = 0
    ) -> None:
        """`index`: the choice this call's answer is (a batch of prompts or n > 1 makes one call
        per choice)."""
        self.meta = meta
        self.index = index
        self.state = GenerationState()
        self.include_usage = include_usage
        self.with_logprobs = with_logprobs
        self._logprobs = LegacyLogprobs()
        self._chars = 0  # characters of text returned so far, for text_offset

    def _record(self, chunk: core_pb2.GenerateChunk) -> dict[str, Any] | None:
        # The tokens' text ends the chunk's text; anything before it is echoed prompt (core may send
        # the echo in the first token's chunk), whose own tokens, when scored, start at its start.
        part = None
        if self.with_logprobs:
            prompt, generated = list(chunk.prompt_logprobs), list(chunk.logprobs)
            part = _logprobs_of(self._logprobs, prompt, generated, chunk.text, start=self._chars)
        self._chars += len(chunk.text)
        return part

    def result(self) -> dict[str, Any]:
        # Whole responses never call on_chunk: rebuild the logprobs from the accumulated state.
        state = self.state
        finish = state.require_finished()
        logprobs = None
        if self.with_logprobs:
            logprobs = _logprobs_of(
                LegacyLogprobs(), state.prompt_logprobs, state.logprobs, state.full_text()
            )
        return self._object(
            [
                {
                    "index": self.index,
                    "text": state.full_text(),
                    "logprobs": logprobs,
                    "finish_reason": finish_reason_name(finish),
                }
            ],
            usage=usage_json(state),
        )

    def opening(self, first: core_pb2.GenerateChunk) -> list[bytes]:
        return []

    def on_chunk(self, chunk: core_pb2.GenerateChunk) -> list[bytes]:
        out = []
        logprobs = self._record(chunk)
        if chunk.text or chunk.logprobs or chunk.prompt_logprobs:
            choice = {"index": self.index, "text": chunk.text, "logprobs": logprobs, "finish_reason": None}
            out.append(sse_data(self._object([choice], usage=None)))
        if chunk.finish_reason != core_pb2.FINISH_REASON_UNSPECIFIED:
            choice = {
                "index": self.index,
                "text": "",
                "logprobs": None,
                "finish_reason": finish_reason_name(chunk.finish_reason),
            }
            out.append(sse_data(self._object([choice], usage=None)))
        return out

    def closing(self, usage: dict[str, Any] | None = None) -> list[bytes]:
        """The last frames; `usage`: the whole answer's, where it has more choices than this one."""
        self.state.require_finished()
        out = []
        if self.include_usage:
            out.append(sse_data(self._object([], usage=usage or usage_json(self.state))))
        out.append(sse_data("[DONE]"))
        return out

    def error_event(self, error: OpenAIError) -> bytes:
        return sse_data(error.body())

    def _object(self, choices: list[dict[str, Any]], *, usage: dict[str, Any] | None) -> dict[str, Any]:
        result: dict[str, Any] = {
            "id": self.meta.id,
            "object": "text_completion",
            "created": self.meta.created,
            "model": self.meta.model,
            "choices": choices,
        }
        if usage is not None or self.include_usage or not choices:
            result["usage"] = usage
        return result


def _logprobs_of(
    logprobs: LegacyLogprobs,
    prompt: list[core_pb2.TokenLogprob],
    generated: list[core_pb2.TokenLogprob],
    text: str,
    start: int = 0,
) -> dict[str, Any]:
    """Record into `logprobs` the scored prompt's tokens (from the start of `text`) and the generated
    ones (at its end); returns their part. `text` starts at character `start` of the answer."""
    prompt_counts = logprobs.characters(prompt)
    counts = logprobs.characters(generated)
    echoed = start + max(len(text) - sum(counts), 0)  # the echoed prompt first, the answer ends the text
    part = logprobs.add(prompt, echoed, prompt_counts, floor=start, prompt=True)
    tail = logprobs.add(generated, start + len(text), counts, floor=echoed)
    return {name: part[name] + tail[name] for name in part}
