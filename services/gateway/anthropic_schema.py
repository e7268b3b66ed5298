"""Pydantic models for the Anthropic Messages request body, `POST /v1/messages`.

Contract: what validates here maps to a `GenerateRequest` (see `anthropic_mapping.py`). Content is a
string or a list of blocks: `text`, `image` (user turns; a base64 or url source, whose image
`image_parts.py` reads, fetches and checks), `tool_use` (assistant turns), `tool_result` (user turns,
text only) and `thinking`/`redacted_thinking` (accepted and dropped, as Anthropic itself drops
earlier turns' thinking from the prompt). Documents and other block types are refused with a 400
naming the block. `max_tokens` is required, as in Anthropic's API.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, ValidationInfo, field_validator, model_validator

from services.gateway.openai_schema import UINT32_MAX, ApiModel, check_tool_schema


class TextBlock(ApiModel):
    type: Literal["text"]
    text: str


class Base64ImageSource(ApiModel):
    type: Literal["base64"]
    media_type: str  # image/png, image/jpeg, image/webp or image/gif: image_parts.py checks it
    data: str


class UrlImageSource(ApiModel):
    type: Literal["url"]
    url: str = Field(min_length=1)


class ImageBlock(ApiModel):
    type: Literal["image"]
    source: Annotated[Base64ImageSource | UrlImageSource, Field(discriminator="type")]


class ToolUseBlock(ApiModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlock(ApiModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: StrictBool = False

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


class ThinkingBlock(ApiModel):
    type: Literal["thinking"]
    thinking: str = ""
    signature: str = ""


class RedactedThinkingBlock(ApiModel):
    type: Literal["redacted_thinking"]
    data: str = ""


ContentBlock = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class Message(ApiModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    @model_validator(mode="after")
    def _images_from_the_user(self) -> Message:
        if self.role == "assistant" and isinstance(self.content, list):
            for j, block in enumerate(self.content):
                if isinstance(block, ImageBlock):  # as Anthropic: the model answers in text
                    raise ValueError(f"content[{j}]: image blocks are accepted in user turns only")
        return self

    def blocks(self) -> list[Any]:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else self.content


class ToolSpec(ApiModel):
    name: str = Field(min_length=1, max_length=128)
    description: str = ""
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})

    _object_input = field_validator("input_schema")(check_tool_schema)


class ToolChoice(ApiModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: StrictBool = False


class ThinkingConfig(ApiModel):
    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = None


class JsonOutputFormat(ApiModel):
    type: Literal["json_schema"]
    # `schema` shadows a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(ApiModel):
    """Anthropic's structured outputs: `format` constrains the text to a JSON Schema."""

    effort: str | None = None  # accepted; the served models have no effort setting
    format: JsonOutputFormat | None = None


class MessagesInput(ApiModel):
    """What a prompt is made of: the body of `POST /v1/messages/count_tokens`."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None

    @field_validator("messages")
    @classmethod
    def _messages_as_anthropic_takes_them(cls, messages: list[Message]) -> list[Message]:
        """What Anthropic's API refuses, refused here with its wording: an empty message (but a
        final assistant prefill), an empty text block, and a tool_result whose tool_use_id no
        tool_use of the message before it carries (a template would pair it with nothing)."""
        for i, message in enumerate(messages):
            blocks = message.blocks()
            last_assistant = i == len(messages) - 1 and message.role == "assistant"
            if not last_assistant and (not blocks or message.content == ""):
                raise ValueError(
                    f"messages[{i}]: all messages must have non-empty content except for the "
                    "optional final assistant message"
                )
            if isinstance(message.content, list) and any(
                isinstance(b, TextBlock) and not b.text for b in blocks
            ):
                raise ValueError(f"messages[{i}]: text content blocks must be non-empty")
            results = [b.tool_use_id for b in blocks if isinstance(b, ToolResultBlock)]
            previous = messages[i - 1].blocks() if i and messages[i - 1].role == "assistant" else []
            uses = {b.id for b in previous if isinstance(b, ToolUseBlock)}
            if unknown := [tool_id for tool_id in results if tool_id not in uses]:
                raise ValueError(
                    f"messages[{i}]: unexpected `tool_use_id` found in `tool_result` blocks: "
                    f"{', '.join(unknown)}. Each `tool_result` block must have a corresponding "
                    "`tool_use` block in the previous message."
                )
        return messages

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_names_a_tool(cls, choice: ToolChoice | None, info: ValidationInfo) -> ToolChoice | None:
        if choice is None:
            return None
        names = {tool.name for tool in info.data.get("tools") or []}
        if choice.type == "any" and not names:
            raise ValueError("tool_choice 'any' needs at least one tool in tools")
        if choice.type == "tool":
            if not choice.name:
                raise ValueError("tool_choice of type 'tool' needs a name")
            if choice.name not in names:
                raise ValueError(f"tool_choice names tool {choice.name!r}, which is not in tools")
        return choice

    def system_text(self) -> str:
        if self.system is None:
            return ""
        return self.system if isinstance(self.system, str) else "".join(b.text for b in self.system)


class MessagesRequest(MessagesInput):
    """`POST /v1/messages` body (Anthropic Messages API)."""

    max_tokens: int = Field(ge=1, le=UINT32_MAX)
    stop_sequences: list[str] | None = Field(default=None, max_length=16)
    stream: StrictBool = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, le=2**31 - 1)
    output_config: OutputConfig | None = None
    # the structured-outputs beta's name for output_config.format, which SDKs still send
    output_format: JsonOutputFormat | None = None
    metadata: dict[str, Any] | None = None
    speculative: StrictBool | None = None  # moe-mesh extension, as on the OpenAI endpoints

    @model_validator(mode="after")
    def _one_output_format(self) -> MessagesRequest:
        if self.output_format is not None and self.output_config is not None and self.output_config.format:
            raise ValueError("give output_config.format or the older output_format, not both")
        return self

    def json_output(self) -> JsonOutputFormat | None:
        """The JSON Schema the text must follow, under either name."""
        if self.output_config is not None and self.output_config.format is not None:
            return self.output_config.format
        return self.output_format

    @field_validator("stop_sequences")
    @classmethod
    def _non_empty_stops(cls, stops: list[str] | None) -> list[str] | None:
        if stops and "" in stops:
            raise ValueError("stop sequences must not be empty strings")
        return stops
