"""What a request asks of its output besides sampling: reasoning, tool calls, echo, grammar.

`OutputPreparer.prepare` turns a GenerateRequest (already tokenized) into the
`OutputSpec` its `TextEmitter` routes by and the logits processors that constrain its
tokens (JSON / JSON Schema response formats, tool_choice required or named). Client
mistakes raise `GrammarError` with a message naming the field; request_prep answers
them with INVALID_ARGUMENT.
"""

from __future__ import annotations

import re

from mlx_lm.tokenizer_utils import TokenizerWrapper

from services.core.structured_output import (
    JSON_TOOL_PARSER,
    GrammarConstraint,
    GrammarError,
    GrammarTokenizer,
    check_grammar,
    marker_term,
    parse_schema,
    response_format_grammar,
    tool_call_grammar,
)
from services.core.text_output import OutputSpec, ToolCallFormat
from services.proto.moemesh.v1 import core_pb2

MAX_TOOLS = 128
TOOL_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")  # OpenAI's rule, plus '.' and ':' (MCP names)
Mode = core_pb2.ToolChoice.Mode


def openai_tools(chat: core_pb2.ChatInput) -> list[dict]:
    """The request's tools as chat templates and mlx-lm's tool parsers expect them,
    checked: names valid and unique, parameters a JSON Schema object."""
    if len(chat.tools) > MAX_TOOLS:
        raise GrammarError(f"chat.tools: at most {MAX_TOOLS} tools")
    tools, names = [], set()
    for index, tool in enumerate(chat.tools):
        field = f"chat.tools[{index}]"
        if not TOOL_NAME.match(tool.name):
            raise GrammarError(
                f"{field}.name: {tool.name!r} must be 1-64 letters, digits, '_', '-', '.' or ':'"
            )
        if tool.name in names:
            raise GrammarError(f"{field}.name: {tool.name!r} is defined twice")
        names.add(tool.name)
        parameters = (
            parse_schema(tool.parameters_json, f"{field}.parameters_json") if tool.parameters_json else {}
        )
        tools.append(
            {
                "type": "function",
                "function": {"name": tool.name, "description": tool.description, "parameters": parameters},
            }
        )
    return tools


def template_tools(chat: core_pb2.ChatInput) -> list[dict]:
    """Tools shown to the model: none when tool_choice is NONE (the model cannot call what it
    does not see, and the answer is plain text)."""
    tools = openai_tools(chat)
    if chat.tool_choice.mode not in Mode.values():
        raise GrammarError(f"tool_choice.mode: unknown mode {chat.tool_choice.mode}")
    return [] if chat.tool_choice.mode == Mode.NONE else tools


def hidden_special_ids(tokenizer: TokenizerWrapper) -> frozenset[int]:
    """The tokenizer's special tokens, less any that a reasoning or tool-call marker is written
    with (the output router reads those): what the text of an answer leaves out."""
    markers = [
        getattr(tokenizer, name, None) or ""
        for name in ("think_start", "think_end", "tool_call_start", "tool_call_end")
    ]
    hidden = set()
    for token_id in getattr(tokenizer, "all_special_ids", None) or ():
        text = tokenizer.convert_ids_to_tokens(token_id)
        if text and not any(text in marker for marker in markers if marker):
            hidden.add(int(token_id))
    return frozenset(hidden)


class OutputPreparer:
    """Per core: knows the model's markers and holds the grammar engine's vocabulary."""

    def __init__(self, tokenizer: TokenizerWrapper, vocab_size: int):
        self.tokenizer = tokenizer
        self.grammar_tokenizer = GrammarTokenizer(tokenizer, vocab_size)
        self.hidden_ids = hidden_special_ids(tokenizer)

    def prepare(self, request: core_pb2.GenerateRequest, prompt: list[int], stop_strings: list[str]):
        """-> (OutputSpec, [logits processors])"""
        tokenizer = self.tokenizer
        reasoning = (tokenizer.think_start, tokenizer.think_end) if tokenizer.has_thinking else None
        in_reasoning = bool(reasoning) and self._prompt_opens_thinking(prompt)
        is_chat = request.WhichOneof("input") == "chat"
        tools = template_tools(request.chat) if is_chat else []
        mode = request.chat.tool_choice.mode if is_chat else Mode.AUTO
        tool_format = None
        if tools and tokenizer.has_tool_calling:
            tool_format = ToolCallFormat(
                start=tokenizer.tool_call_start,
                end=tokenizer.tool_call_end,
                parse=tokenizer.tool_parser,
                tools=tools,
            )
        if tools and tool_format is None and mode == Mode.AUTO:
            # the template would drop them or the calls would come back as plain text: either
            # way the client would never learn that its tools were not offered (vLLM: a 400 too)
            raise GrammarError(
                "chat.tools: this model has no tool-call format, so it cannot call tools; "
                "leave tools out or set tool_choice to none"
            )
        grammar, field = None, ""
        if request.response_format.type != core_pb2.ResponseFormat.TEXT:
            grammar, field = response_format_grammar(request.response_format), "response_format"
        if mode in (Mode.REQUIRED, Mode.NAMED):
            if grammar is not None:
                raise GrammarError("response_format: cannot be combined with tool_choice required or named")
            grammar, field = self._tool_choice_grammar(request.chat, tools, tool_format), "chat.tools"
        processors = []
        if grammar is not None:
            vocabulary = self.grammar_tokenizer.get()
            check_grammar(grammar, vocabulary, field)
            wait_for = tuple(tokenizer.think_end_tokens) if in_reasoning else ()
            processors.append(GrammarConstraint(vocabulary, grammar, wait_for))
        echo = ""
        if request.echo:
            echo = request.prompt if request.WhichOneof("input") == "prompt" else tokenizer.decode(prompt)
        spec = OutputSpec(
            stop_strings=stop_strings,
            reasoning_markers=reasoning,
            starts_in_reasoning=in_reasoning,
            tool_calls=tool_format,
            echo=echo,
            hidden_ids=self.hidden_ids,
        )
        return spec, processors

    def _tool_choice_grammar(
        self, chat: core_pb2.ChatInput, tools: list[dict], tool_format: ToolCallFormat | None
    ) -> str:
        choice = chat.tool_choice
        mode_name = "required" if choice.mode == Mode.REQUIRED else "a named function"
        if not tools:
            raise GrammarError(f"tool_choice: {mode_name} needs at least one tool in chat.tools")
        if tool_format is None:
            raise GrammarError(
                f"tool_choice: {mode_name} is not possible, this model has no tool-call format"
            )
        if getattr(tool_format.parse, "__module__", "") != JSON_TOOL_PARSER:
            raise GrammarError(
                f"tool_choice: {mode_name} needs constrained decoding, implemented for the JSON tool-call "
                f"format ({tool_format.start}{{...}}{tool_format.end}); this model's format is "
                f"{getattr(tool_format.parse, '__module__', '?').rsplit('.', 1)[-1]}"
            )
        allowed = [t["function"] for t in tools]
        if choice.mode == Mode.NAMED:
            allowed = [t for t in allowed if t["name"] == choice.function_name]
            if not allowed:
                raise GrammarError(
                    f"tool_choice.function_name: no tool named {choice.function_name!r} in chat.tools"
                )
        vocabulary = self.grammar_tokenizer.get()
        tokenizer = self.tokenizer
        start = marker_term(tokenizer.tool_call_start, tokenizer.tool_call_start_tokens, vocabulary)
        end = marker_term(tokenizer.tool_call_end, tokenizer.tool_call_end_tokens, vocabulary)
        return tool_call_grammar(allowed, start, end, single=choice.mode == Mode.NAMED)

    def _prompt_opens_thinking(self, prompt: list[int]) -> bool:
        """True when the prompt's last thinking marker opens a block (templates such as
        Qwen3-Thinking-2507 start the assistant turn inside `<think>`)."""
        start = _rfind(prompt, tuple(self.tokenizer.think_start_tokens or ()))
        return start >= 0 and start > _rfind(prompt, tuple(self.tokenizer.think_end_tokens or ()))


def _rfind(tokens: list[int], marker: tuple[int, ...]) -> int:
    if not marker:
        return -1
    width = len(marker)
    if width == 1:  # the common case (one special token): C speed over long prompts
        try:
            return len(tokens) - 1 - tokens[::-1].index(marker[0])
        except ValueError:
            return -1
    for index in range(len(tokens) - width, -1, -1):
        if tuple(tokens[index : index + width]) == marker:
            return index
    return -1
