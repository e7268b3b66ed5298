"""Pydantic models for the OpenAI Chat Completions request body.

Contract: a request that validates here can always be mapped to a `GenerateRequest`; anything the
server cannot honour is rejected *here*, so the client gets a 400 naming the field instead of a
silently different answer (`n` > 1, `tool_choice` that forces a call, non-text content parts).

Unknown fields are ignored, as vLLM does: clients written for other servers send extras
(`parallel_tool_calls`, `metadata`, `store`, ...) and should not fail because of them.

Growth path: content parts are a discriminated union (add `ImageContentPart` to `ContentPart`),
and every model derives from `ApiModel`, so the Anthropic Messages models can live next to these and
share the same validation-to-400 machinery in `errors.py`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1


class ApiModel(BaseModel):
    """Base for every request model: extra fields are accepted and dropped."""

    model_config = ConfigDict(extra="ignore")


class TextContentPart(ApiModel):
    type: Literal["text"]
    text: str


# A discriminated union of one member today; image/audio parts join it later.
ContentPart = Annotated[TextContentPart, Field(discriminator="type")]


class FunctionCall(ApiModel):
    name: str
    arguments: str = ""  # JSON text, passed through untouched: the chat template decides.


class ToolCall(ApiModel):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(ApiModel):
    """One conversation turn. `content` may be absent for an assistant turn that only calls tools."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        """The content as one string: text parts are joined without separators, as OpenAI does."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDefinition(ApiModel):
    name: str = Field(min_length=1)
    description: str = ""
    parameters: dict[str, Any] | None = None


class ToolDefinition(ApiModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedToolChoiceFunction(ApiModel):
    name: str


class NamedToolChoice(ApiModel):
    type: Literal["function"] = "function"
    function: NamedToolChoiceFunction


class StreamOptions(ApiModel):
    include_usage: bool = False


class ChatCompletionRequest(ApiModel):
    """`POST /v1/chat/completions` body (OpenAI, plus vLLM's common sampling extensions)."""

    model: str = ""  # empty: core serves its one model
    messages: list[ChatMessage] = Field(min_length=1)

    stream: bool = False
    stream_options: StreamOptions | None = None

    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # extension; -1 or 0 = disabled (vLLM)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), le=UINT64_MAX)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)

    max_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=UINT32_MAX)]] | None = None  # vLLM extension
    ignore_eos: bool = False  # vLLM extension, handy for benchmarks

    n: int = 1
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    user: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM extension, e.g. {"enable_thinking": false}

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, n: int) -> int:
        # Core generates one sequence per request; several choices would need n sequences with
        # shared prefill, which the scheduler does not do yet.
        if n != 1:
            raise ValueError(f"n={n} is not supported: this server returns exactly one choice (n=1)")
        return n

    @field_validator("stop")
    @classmethod
    def _stop_list_size(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > 16:
            raise ValueError("at most 16 stop sequences are allowed")
        return stop

    @field_validator("tool_choice")
    @classmethod
    def _supported_tool_choice(
        cls, choice: Literal["none", "auto", "required"] | NamedToolChoice | None
    ) -> Literal["none", "auto", "required"] | NamedToolChoice | None:
        # Forcing a tool call needs constrained decoding in core; pretending would return text
        # the client did not ask for, so refuse clearly instead.
        if choice == "required" or isinstance(choice, NamedToolChoice):
            raise ValueError("only tool_choice 'auto' and 'none' are supported by this server")
        return choice

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs=true")
        return top

    def stop_sequences(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def max_new_tokens(self) -> int | None:
        """`max_completion_tokens` is the current OpenAI name; `max_tokens` the deprecated one."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)
