"""Anthropic Messages request → core's `GenerateRequest`.

Contract: Anthropic's block structure becomes the role/tool-call structure chat templates know:
`system` → a system message; an assistant turn's `tool_use` blocks → that message's tool calls (input
as JSON text); a user turn's `tool_result` blocks → `tool` messages carrying `tool_call_id`, in the
order they appear, with the turn's text around them as user messages; thinking blocks are dropped.
Where such a user message holds images, it goes to core as its text and image parts in order
(`content` empty), each image as `image_parts.py` loaded it; without images, as its text alone.
tool_choice auto/any/tool/none → core's AUTO/REQUIRED/NAMED/NONE; `output_config.format` (structured
outputs; the beta's `output_format` too) → a JSON_SCHEMA response format.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from services.gateway.anthropic_schema import (
    ImageBlock,
    Message,
    MessagesInput,
    MessagesRequest,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from services.proto.moemesh.v1 import core_pb2

if TYPE_CHECKING:
    from services.gateway.image_parts import Images

TOOL_CHOICE_MODES = {
    "auto": core_pb2.ToolChoice.AUTO,
    "any": core_pb2.ToolChoice.REQUIRED,
    "tool": core_pb2.ToolChoice.NAMED,
    "none": core_pb2.ToolChoice.NONE,
}


def core_messages(request: MessagesInput, images: Images | None = None) -> list[core_pb2.ChatMessage]:
    """`images`: the request's images, loaded (`image_parts.messages_image_sources`); needed where
    it has any."""
    out: list[core_pb2.ChatMessage] = []
    if system := request.system_text():
        out.append(core_pb2.ChatMessage(role="system", content=system))
    for i, message in enumerate(request.messages):
        out.extend(_user_turn(message, i, images) if message.role == "user" else [_assistant_turn(message)])
    return out


def _user_turn(message: Message, index: int, images: Images | None) -> list[core_pb2.ChatMessage]:
    out: list[core_pb2.ChatMessage] = []
    parts: list[core_pb2.ContentPart] = []  # text and images since the last tool_result

    def flush_parts() -> None:
        if any(part.HasField("image") for part in parts):
            out.append(core_pb2.ChatMessage(role="user", parts=parts))
        elif parts:
            out.append(core_pb2.ChatMessage(role="user", content="".join(part.text for part in parts)))
        parts.clear()

    for j, block in enumerate(message.blocks()):
        if isinstance(block, TextBlock):
            parts.append(core_pb2.ContentPart(text=block.text))
        elif isinstance(block, ImageBlock):
            if images is None or (index, j) not in images:
                raise ValueError(f"messages[{index}].content[{j}]: the image was not loaded (image_parts.py)")
            parts.append(core_pb2.ContentPart(image=images[index, j]))
        elif isinstance(block, ToolResultBlock):
            flush_parts()
            content = block.text()
            out.append(
                core_pb2.ChatMessage(
                    role="tool",
                    content=f"Error: {content}" if block.is_error else content,
                    tool_call_id=block.tool_use_id,
                )
            )
        # tool_use in a user turn and thinking blocks carry nothing a template can show
    flush_parts()
    return out or [core_pb2.ChatMessage(role="user", content="")]


def _assistant_turn(message: Message) -> core_pb2.ChatMessage:
    blocks = message.blocks()
    calls = [block for block in blocks if isinstance(block, ToolUseBlock)]
    return core_pb2.ChatMessage(
        role="assistant",
        content="".join(block.text for block in blocks if isinstance(block, TextBlock)),
        tool_calls=[
            core_pb2.ToolCall(id=call.id, name=call.name, arguments=json.dumps(call.input), index=i)
            for i, call in enumerate(calls)
        ],
    )


def chat_input(request: MessagesInput, images: Images | None = None) -> core_pb2.ChatInput:
    choice = request.tool_choice
    mode = TOOL_CHOICE_MODES[choice.type] if choice else core_pb2.ToolChoice.AUTO
    messages = core_messages(request, images)
    chat = core_pb2.ChatInput(
        messages=messages,
        add_generation_prompt=True,
        # a final assistant turn is a prefill: the answer continues it (and does not repeat it)
        continue_final_message=messages[-1].role == "assistant",
        tool_choice=core_pb2.ToolChoice(
            mode=mode, function_name=choice.name or "" if choice and choice.type == "tool" else ""
        ),
    )
    if request.tools and mode != core_pb2.ToolChoice.NONE:
        chat.tools.extend(
            core_pb2.Tool(
                name=tool.name, description=tool.description, parameters_json=json.dumps(tool.input_schema)
            )
            for tool in request.tools
        )
    if request.thinking is not None:
        chat.template_kwargs_json = json.dumps({"enable_thinking": request.thinking.type == "enabled"})
    return chat


def build_messages_request(
    request: MessagesRequest, request_id: str, images: Images | None = None
) -> core_pb2.GenerateRequest:
    sampling = core_pb2.SamplingParams()
    if request.temperature is not None:
        sampling.temperature = request.temperature
    if request.top_p is not None:
        sampling.top_p = request.top_p
    if request.top_k:
        sampling.top_k = request.top_k
    generate = core_pb2.GenerateRequest(
        request_id=request_id,
        model=request.model,
        chat=chat_input(request, images),
        sampling=sampling,
        stopping=core_pb2.StoppingCriteria(max_tokens=request.max_tokens, stop=request.stop_sequences or []),
    )
    if request.speculative is not None:
        generate.speculative = request.speculative
    if (output := request.json_output()) is not None:
        generate.response_format.CopyFrom(
            core_pb2.ResponseFormat(
                type=core_pb2.ResponseFormat.JSON_SCHEMA,
                schema_json=json.dumps(output.json_schema),
                name="output",
                strict=True,
            )
        )
    return generate
