"""Pydantic models for the OpenAI Chat Completions request body.

Contract: a request that validates here can always be mapped to a `GenerateRequest`; anything the
server cannot honour is rejected *here*, so the client gets a 400 naming the field instead of a
silently different answer (an image in a non-user message, a tool_choice naming an unknown
tool). Image parts are only parsed here; `image_parts.py` reads, fetches and checks their images.

Unknown fields are ignored, as vLLM does: clients written for other servers send extras
(`parallel_tool_calls`, `metadata`, `store`, ...) and should not fail because of them.

Content parts are a discriminated union on `type` (text, image_url), and every model derives from
`ApiModel`, so the completions and Anthropic models share the same validation-to-400 machinery in
`errors.py`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationInfo,
    field_validator,
    model_validator,
)

UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
MAX_CHOICES = 256  # choices per request (`n`, times the prompts of a completions batch)


class ApiModel(BaseModel):
    """Base for every request model: extra fields are accepted and dropped; every string in a
    field must be valid Unicode; numbers must be finite (NaN and Infinity, which Python's JSON
    reader takes, are refused as such)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """OpenAI's API, its SDKs' types and vLLM read an explicit null as "not given": a field
        that has a default takes it (`"n": null` is n=1); a required field stays refused."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        defaulted = {
            key
            for key, value in data.items()
            if value is None
            and key in fields
            and not fields[key].is_required()
            and fields[key].default is not None
        }
        return {key: value for key, value in data.items() if key not in defaulted} if defaulted else data

    @field_validator("*", mode="after")
    @classmethod
    def _encodable_text(cls, value: Any) -> Any:
        _check_encodable(value)
        return value


def _check_encodable(value: Any) -> None:
    """JSON may escape a lone UTF-16 surrogate ("\\ud800"), which Python decodes to a string no
    UTF-8 encoder (protobuf's, the tokenizer's) accepts: refuse it here, a 400 naming the field,
    rather than a 500 later. Nested models check their own fields."""
    if isinstance(value, str):
        if value.isascii():  # constant time in CPython; spares copying a large base64 image
            return
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            raise ValueError(
                f"text holds a lone UTF-16 surrogate (U+{ord(value[error.start]):04X}) at index "
                f"{error.start}: not valid Unicode"
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_encodable(key)
            _check_encodable(item)
    elif isinstance(value, list | tuple):
        if value and isinstance(value[0], int | float) and isinstance(value[-1], int | float):
            return  # token ids, numbers: nothing to encode (and prompts of 100K ids)
        for item in value:
            _check_encodable(item)


class TextContentPart(ApiModel):
    type: Literal["text"]
    text: str


class ImageUrl(ApiModel):
    url: str = Field(min_length=1)  # a data: URL (base64), or http(s) where the gateway fetches them
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model sees the image as it is


class ImageContentPart(ApiModel):
    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[TextContentPart | ImageContentPart, Field(discriminator="type")]


class FunctionCall(ApiModel):
    name: str
    arguments: str = ""  # JSON text, passed through untouched: the chat template decides.


class ToolCall(ApiModel):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(ApiModel):
    """One conversation turn. `content` may be absent for an assistant turn that only calls tools."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _required_parts(self) -> ChatMessage:
        # as OpenAI: only an assistant turn may go without content (it calls tools instead)
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content is required in a {self.role} message")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("tool_call_id is required in a tool message")
        if self.role != "user" and isinstance(self.content, list):
            for j, part in enumerate(self.content):
                if isinstance(part, ImageContentPart):  # as OpenAI: only the user shows images
                    raise ValueError(
                        f"content[{j}]: image_url parts are accepted in user messages only, "
                        f"not in a {self.role} message"
                    )
        return self

    def core_role(self) -> str:
        """OpenAI's newer `developer` role is the system prompt for open-weight chat templates."""
        return "system" if self.role == "developer" else self.role

    def text(self) -> str:
        """The content's text as one string: text parts are joined without separators, as OpenAI
        does (a message with images goes to core as parts instead, see `has_images`)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextContentPart))

    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(isinstance(p, ImageContentPart) for p in self.content)


def check_tool_schema(schema: dict[str, Any] | None) -> dict[str, Any] | None:
    """A tool's arguments are a JSON object, so its schema must describe one (OpenAI and Anthropic
    refuse anything else); a schema that says nothing of its type is taken as an object's."""
    if schema is not None and "type" in schema and schema["type"] != "object":
        raise ValueError(f'must be a JSON Schema of type "object", got type {json.dumps(schema["type"])}')
    return schema


class FunctionDefinition(ApiModel):
    name: str = Field(min_length=1)
    description: str = ""
    parameters: dict[str, Any] | None = None

    _object_parameters = field_validator("parameters")(check_tool_schema)


class ToolDefinition(ApiModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedToolChoiceFunction(ApiModel):
    name: str


class NamedToolChoice(ApiModel):
    type: Literal["function"] = "function"
    function: NamedToolChoiceFunction


class StreamOptions(ApiModel):
    include_usage: StrictBool = False


class TextResponseFormat(ApiModel):
    type: Literal["text"]


class JsonObjectResponseFormat(ApiModel):
    type: Literal["json_object"]


class JsonSchemaSpec(ApiModel):
    name: str = Field(default="response", max_length=64)
    description: str = ""
    # `schema` shadows a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: StrictBool | None = None


class JsonSchemaResponseFormat(ApiModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[
    TextResponseFormat | JsonObjectResponseFormat | JsonSchemaResponseFormat, Field(discriminator="type")
]
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's documented range is -100..100
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_STOP_SEQUENCES = 16


def validate_logit_bias(bias: dict[str, float] | None) -> dict[str, float] | None:
    """Keys are token ids as strings (JSON object keys); values within -100..100."""
    if bias is None:
        return None
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(f"at most {MAX_LOGIT_BIAS_ENTRIES} entries are allowed")
    for key, value in bias.items():
        if not key.isdigit() or int(key) > UINT32_MAX:
            raise ValueError(f"keys must be token ids (non-negative integers), got {key!r}")
        if not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
            raise ValueError(f"bias for token {key} must be within -100..100, got {value}")
    return bias


class GenerationOptions(ApiModel):
    """Sampling and stopping fields shared by chat and text completions (OpenAI plus vLLM's extensions)."""

    model: str = ""  # empty: core serves its one model
    stream: StrictBool = False
    stream_options: StreamOptions | None = None

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_a_stream(cls, options: StreamOptions | None, info: ValidationInfo):
        if options is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return options

    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=2**31 - 1)  # extension; -1 or 0 = disabled (vLLM)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), le=UINT64_MAX)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    logit_bias: dict[str, float] | None = None

    max_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=UINT32_MAX)]] | None = None  # vLLM extension
    ignore_eos: StrictBool = False  # vLLM extension, handy for benchmarks
    # moe-mesh extension: this request's KV cache kind ("fp16" | "turboquant"); core validates it.
    kv_cache: str | None = Field(default=None, max_length=32)
    # moe-mesh extension: false decodes this request without drafted tokens where core speculates
    speculative: StrictBool | None = None

    n: int = Field(default=1, ge=1, le=MAX_CHOICES)  # choices: each its own sequence (choices.py)
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_sequences(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
        if stop == "" or (isinstance(stop, list) and "" in stop):
            raise ValueError("stop sequences must not be empty strings")
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        return validate_logit_bias(bias)

    def stop_sequences(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(GenerationOptions):
    """`POST /v1/chat/completions` body."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    response_format: ResponseFormat | None = None
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM extension, e.g. {"enable_thinking": false}
    # vLLM extensions: continue the final assistant message (a prefill) instead of opening a new turn
    continue_final_message: StrictBool = False
    add_generation_prompt: StrictBool = True

    @model_validator(mode="after")
    def _continuation_is_consistent(self) -> ChatCompletionRequest:
        if self.continue_final_message:
            if self.messages[-1].role != "assistant":
                raise ValueError("continue_final_message needs the last message to be an assistant message")
            if self.add_generation_prompt:
                raise ValueError("continue_final_message needs add_generation_prompt=false")
        elif not self.add_generation_prompt:
            raise ValueError("add_generation_prompt=false is served only with continue_final_message=true")
        return self

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_names_a_tool(
        cls, choice: Literal["none", "auto", "required"] | NamedToolChoice | None, info: ValidationInfo
    ) -> Literal["none", "auto", "required"] | NamedToolChoice | None:
        names = {tool.function.name for tool in info.data.get("tools") or []}
        if choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs at least one tool in tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names function {choice.function.name!r}, which is not in tools")
        return choice

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs=true")
        return top

    def max_new_tokens(self) -> int | None:
        """`max_completion_tokens` is the current OpenAI name; `max_tokens` the deprecated one."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
