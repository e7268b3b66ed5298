"""Token ids -> what a chunk carries: content text, reasoning text and parsed tool calls.

One `TextEmitter` per sequence. It detokenizes and routes the text through a small
state machine over the model's own markers:

    content --<think>--> reasoning --</think>--> content
    content --<tool_call>--> tool call --</tool_call>--> content (+ one parsed ToolCall)

Text that might be the start of a marker or of a stop string is held back until it is
known not to be one, so neither a stop string nor a marker nor the inside of a tool
call ever reaches the client as content, even when split across tokens. Stop strings
apply to content (not to reasoning or tool-call text).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer

from services.common.logging import get_logger
from services.proto.moemesh.v1 import core_pb2

log = get_logger(__name__)

CONTENT, REASONING, TOOL_CALL = "content", "reasoning", "tool_call"


@dataclass(frozen=True)
class ToolCallFormat:
    """How this model writes tool calls: markers around each call and mlx-lm's parser
    for the text between them (`parse(text, tools) -> {"name", "arguments"}` or a list)."""

    start: str
    end: str
    parse: Callable
    tools: list[dict]  # the request's tools in OpenAI form, as the parsers expect


@dataclass(frozen=True)
class OutputSpec:
    """What a request's output stream needs to know besides its tokens."""

    stop_strings: list[str] = field(default_factory=list)
    reasoning_markers: tuple[str, str] | None = None  # (think start, think end)
    starts_in_reasoning: bool = False  # the prompt opened a thinking block
    tool_calls: ToolCallFormat | None = None  # None: tool calls are not parsed
    echo: str = ""  # sent before the first generated text (completions' echo)
    # control tokens (<|im_start|>, <|endoftext|>, ...) never written into the text, as vLLM's
    # skip_special_tokens: their text is no part of an answer and would break stop strings and JSON
    hidden_ids: frozenset[int] = frozenset()


@dataclass
class OutputDelta:
    text: str = ""
    reasoning: str = ""
    tool_calls: list[core_pb2.ToolCall] = field(default_factory=list)
    matched_stop: str = ""  # on the final delta: the stop string that ended the output

    def write_to(self, chunk: core_pb2.GenerateChunk) -> None:
        chunk.text += self.text
        chunk.reasoning += self.reasoning
        chunk.tool_calls.extend(self.tool_calls)
        if self.matched_stop:
            chunk.matched_stop = self.matched_stop


class TextEmitter:
    """Streams one sequence's output: `add(token)` per generated token, `finish()` once.

    `stopped` turns true when a stop string appeared in the content (the engine then
    ends the sequence); `finish_reason(reason)` turns a STOP into TOOL_CALLS when the
    response holds tool calls.
    """

    def __init__(self, detokenizer, output: OutputSpec | list[str]):
        if not isinstance(output, OutputSpec):
            output = OutputSpec(stop_strings=list(output))
        self.detokenizer = detokenizer
        if isinstance(detokenizer, BPEStreamingDetokenizer) and not detokenizer.text:
            # mlx-lm drops the first token's leading space: right for a whole text, wrong for
            # a continuation (" Paris" after "The capital of France is"). A placeholder
            # already "sent" keeps every space.
            detokenizer.text, detokenizer.offset = "\0", 1
        elif isinstance(detokenizer, SPMStreamingDetokenizer):
            detokenizer.trim_space = False  # the same, for SentencePiece models
        self.output = output
        self.stop_strings = [s for s in output.stop_strings if s]
        self.state = REASONING if output.reasoning_markers and output.starts_in_reasoning else CONTENT
        self.pending = ""  # decoded, not yet routed (could begin a marker or stop string)
        self.tool_text = ""  # inside the current tool call
        self.held_whitespace = ""  # whitespace after a marker, sent only if content follows
        self.drop_whitespace = False  # after </think>: leading whitespace of the answer is dropped
        self.tool_calls_sent = 0
        self.stopped = False
        self.matched_stop = ""  # the stop string that ended the output, once one did
        self._echo = output.echo

    def add(self, token: int) -> OutputDelta:
        """Feed one token; return what is safe to send now."""
        if token not in self.output.hidden_ids:
            self.detokenizer.add_token(token)
            self.pending += self.detokenizer.last_segment
        return self._route(final=False)

    def finish(self) -> OutputDelta:
        """End of generation: flush everything still held (minus any stop string)."""
        self.detokenizer.finalize()
        # A character the token limit cut off leaves bytes that decode to U+FFFD: they are dropped,
        # not sent as a replacement character (streaming held them back already, as vLLM does).
        self.pending += self.detokenizer.last_segment.rstrip("\ufffd")
        delta = self._route(final=True)
        delta.matched_stop = self.matched_stop
        return delta

    def finish_reason(self, reason: int) -> int:
        # Whenever the answer holds tool calls, as OpenAI and mlx-lm's server report it:
        # agents run the tools when they see tool_calls.
        if reason == core_pb2.FinishReason.STOP and self.tool_calls_sent:
            return core_pb2.FinishReason.TOOL_CALLS
        if self.matched_stop:  # also when the stop string came with the last allowed token
            return core_pb2.FinishReason.STOP
        return reason

    # ---- routing ----------------------------------------------------------------------------

    def _route(self, final: bool) -> OutputDelta:
        delta = OutputDelta(text=self._echo)
        self._echo = ""
        while not self.stopped:
            if self.state == REASONING:
                progressed = self._route_reasoning(delta, final)
            elif self.state == TOOL_CALL:
                progressed = self._route_tool_call(delta, final)
            else:
                progressed = self._route_content(delta, final)
            if not progressed:
                break
        if final and not self.stopped:
            self.held_whitespace = ""  # trailing whitespace after a tool call or thinking
        return delta

    def _route_reasoning(self, delta: OutputDelta, final: bool) -> bool:
        end = self.output.reasoning_markers[1]
        cut = self.pending.find(end)
        if cut >= 0:
            delta.reasoning += self.pending[:cut]
            self.pending = self.pending[cut + len(end) :]
            self.state, self.drop_whitespace = CONTENT, True
            return True
        hold = 0 if final else _partial_suffix(self.pending, [end])
        delta.reasoning += self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(self.pending) - hold :]
        return False

    def _route_tool_call(self, delta: OutputDelta, final: bool) -> bool:
        tool_format = self.output.tool_calls
        self.tool_text += self.pending
        self.pending = ""
        # A format without an end marker (e.g. Mistral's [TOOL_CALLS]) runs to the end of the output.
        cut = self.tool_text.find(tool_format.end) if tool_format.end else -1
        if cut < 0 and not final:
            return False
        body = self.tool_text if cut < 0 else self.tool_text[:cut]
        rest = "" if cut < 0 else self.tool_text[cut + len(tool_format.end) :]
        self.tool_text, self.state, self.pending = "", CONTENT, rest
        calls = self._parse_tool_call(body)
        if calls is None:  # not a tool call after all: the model's text goes out as it was
            closing = tool_format.end if cut >= 0 else ""
            self._send_content(delta, tool_format.start + body + closing)
        else:
            delta.tool_calls.extend(calls)
        return True

    def _route_content(self, delta: OutputDelta, final: bool) -> bool:
        markers = {}
        if self.output.reasoning_markers:
            markers[self.output.reasoning_markers[0]] = REASONING
        if self.output.tool_calls:
            markers[self.output.tool_calls.start] = TOOL_CALL
        found = [(self.pending.find(m), m) for m in [*markers, *self.stop_strings]]
        found = [(index, m) for index, m in found if index >= 0]
        if found:
            index, marker = min(found, key=lambda hit: (hit[0], -len(hit[1])))
            self._send_content(delta, self.pending[:index])
            self.pending = self.pending[index + len(marker) :]
            if marker in markers:
                self.state = markers[marker]
                self.held_whitespace = ""
                return True
            self.stopped, self.matched_stop = True, marker  # a stop string: nothing after it is sent
            self.pending = ""
            return False
        hold = 0 if final else _partial_suffix(self.pending, [*markers, *self.stop_strings])
        self._send_content(delta, self.pending[: len(self.pending) - hold])
        self.pending = self.pending[len(self.pending) - hold :]
        return False

    def _send_content(self, delta: OutputDelta, text: str) -> None:
        if not text:
            return
        text = self.held_whitespace + text
        self.held_whitespace = ""
        if self.drop_whitespace:
            text = text.lstrip()
            self.drop_whitespace = not text
        elif self.tool_calls_sent and not text.strip():
            self.held_whitespace = text  # e.g. the newline between two tool calls
            return
        delta.text += text

    def _parse_tool_call(self, body: str) -> list[core_pb2.ToolCall] | None:
        tool_format = self.output.tool_calls
        try:
            parsed = tool_format.parse(body, tool_format.tools)
        except Exception as error:  # noqa: BLE001 - mlx-lm's parsers raise whatever their format does
            log.warning("tool_call_unparsed", error=str(error), text=body[:200])
            return None
        calls = []
        for item in parsed if isinstance(parsed, list) else [parsed]:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                log.warning("tool_call_unparsed", error="no function name", text=body[:200])
                return None
            arguments = item.get("arguments", {})
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments, ensure_ascii=False)
            calls.append(
                core_pb2.ToolCall(
                    id=f"call_{uuid.uuid4().hex[:24]}",
                    name=item["name"],
                    arguments=arguments,
                    index=self.tool_calls_sent + len(calls),
                )
            )
        self.tool_calls_sent += len(calls)
        return calls


def _partial_suffix(text: str, markers: list[str]) -> int:
    """Length of the longest end of `text` that is a proper prefix of one of `markers`."""
    hold = 0
    for marker in markers:
        for length in range(min(len(marker) - 1, len(text)), hold, -1):
            if text.endswith(marker[:length]):
                hold = length
                break
    return hold
