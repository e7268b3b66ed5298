"""OpenAI chat and text completion requests → core's `GenerateRequest`.

Contract: unset options stay unset, so core applies the model's own defaults (generation_config)
rather than ours; everything the schema accepted is carried over, nothing is silently dropped.
A message with images goes to core as its parts in order (text, image, ...) with `content` empty,
each image as `image_parts.py` loaded it; a message without images as its text alone.
Pure functions, testable without sockets.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from services.gateway.choices import one_per_choice
from services.gateway.completions_schema import CompletionRequest
from services.gateway.openai_schema import (
    ChatCompletionRequest,
    ChatMessage,
    GenerationOptions,
    JsonObjectResponseFormat,
    JsonSchemaResponseFormat,
    NamedToolChoice,
    TextContentPart,
)
from services.proto.moemesh.v1 import core_pb2

if TYPE_CHECKING:
    from services.gateway.image_parts import Images

UINT64_MASK = 2**64 - 1
TOOL_CHOICE_MODES = {
    None: core_pb2.ToolChoice.AUTO,
    "auto": core_pb2.ToolChoice.AUTO,
    "none": core_pb2.ToolChoice.NONE,
    "required": core_pb2.ToolChoice.REQUIRED,
}


def sampling_params(options: GenerationOptions) -> core_pb2.SamplingParams:
    sampling = core_pb2.SamplingParams()
    for name in (
        "temperature",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
    ):
        value = getattr(options, name)
        if value is not None:
            setattr(sampling, name, value)
    if options.top_k is not None and options.top_k > 0:  # -1 and 0 both mean "no top-k"
        sampling.top_k = options.top_k
    if options.seed is not None:
        sampling.seed = options.seed & UINT64_MASK  # OpenAI seeds are signed; core's are uint64
    for token, bias in (options.logit_bias or {}).items():
        sampling.logit_bias[int(token)] = bias
    return sampling


def stopping_criteria(options: GenerationOptions) -> core_pb2.StoppingCriteria:
    stopping = core_pb2.StoppingCriteria(
        stop=options.stop_sequences(),
        stop_token_ids=options.stop_token_ids or [],
        ignore_eos=options.ignore_eos,
    )
    if (max_tokens := options.max_new_tokens()) is not None:
        stopping.max_tokens = max_tokens
    return stopping


def tool_choice(choice: str | NamedToolChoice | None) -> core_pb2.ToolChoice:
    if isinstance(choice, NamedToolChoice):
        return core_pb2.ToolChoice(mode=core_pb2.ToolChoice.NAMED, function_name=choice.function.name)
    return core_pb2.ToolChoice(mode=TOOL_CHOICE_MODES[choice])


def response_format(request: ChatCompletionRequest) -> core_pb2.ResponseFormat | None:
    spec = request.response_format
    if isinstance(spec, JsonObjectResponseFormat):
        return core_pb2.ResponseFormat(type=core_pb2.ResponseFormat.JSON_OBJECT)
    if isinstance(spec, JsonSchemaResponseFormat):
        return core_pb2.ResponseFormat(
            type=core_pb2.ResponseFormat.JSON_SCHEMA,
            schema_json=json.dumps(spec.json_schema.json_schema),
            name=spec.json_schema.name,
            strict=bool(spec.json_schema.strict),
        )
    return None  # text: nothing to constrain


def build_chat_request(
    request: ChatCompletionRequest, request_id: str, images: Images | None = None
) -> core_pb2.GenerateRequest:
    generate = core_pb2.GenerateRequest(
        request_id=request_id,
        model=request.model,
        chat=chat_input(request, images),
        sampling=sampling_params(request),
        stopping=stopping_criteria(request),
        logprobs=request.logprobs,
        top_logprobs=request.top_logprobs or 0,
        kv_cache=request.kv_cache or "",
    )
    if (structured := response_format(request)) is not None:
        generate.response_format.CopyFrom(structured)
    if request.speculative is not None:
        generate.speculative = request.speculative
    return generate


def chat_input(request: ChatCompletionRequest, images: Images | None = None) -> core_pb2.ChatInput:
    """The conversation part of a chat request: messages, tools, template arguments. `images`:
    the request's images, loaded (`image_parts.chat_image_sources`); needed where it has any."""
    chat = core_pb2.ChatInput(
        messages=[chat_message(message, i, images) for i, message in enumerate(request.messages)],
        add_generation_prompt=True,
        continue_final_message=request.continue_final_message,
        tool_choice=tool_choice(request.tool_choice),
    )
    # tool_choice "none": the model must not call tools; core also gets the mode, so a template
    # that renders tools anyway cannot lead to a parsed call.
    if request.tools and request.tool_choice != "none":
        chat.tools.extend(
            core_pb2.Tool(
                name=tool.function.name,
                description=tool.function.description,
                parameters_json=json.dumps(tool.function.parameters) if tool.function.parameters else "",
            )
            for tool in request.tools
        )
    if request.chat_template_kwargs:
        chat.template_kwargs_json = json.dumps(request.chat_template_kwargs)
    return chat


def chat_message(message: ChatMessage, index: int = 0, images: Images | None = None) -> core_pb2.ChatMessage:
    """`index`: the message's place in the request, which keys its images in `images`."""
    out = core_pb2.ChatMessage(
        role=message.core_role(),
        name=message.name or "",
        tool_call_id=message.tool_call_id or "",
        tool_calls=[
            core_pb2.ToolCall(id=call.id, name=call.function.name, arguments=call.function.arguments, index=i)
            for i, call in enumerate(message.tool_calls or [])
        ],
    )
    if not isinstance(message.content, list) or not message.has_images():
        out.content = message.text()
        return out
    for j, part in enumerate(message.content):
        if isinstance(part, TextContentPart):
            out.parts.add(text=part.text)
        elif images is None or (index, j) not in images:
            raise ValueError(f"messages[{index}].content[{j}]: the image was not loaded (image_parts.py)")
        else:
            out.parts.add(image=images[index, j])
    return out


def build_completion_request(request: CompletionRequest, request_id: str) -> core_pb2.GenerateRequest:
    generate = core_pb2.GenerateRequest(
        request_id=request_id,
        model=request.model,
        sampling=sampling_params(request),
        stopping=stopping_criteria(request),
        # OpenAI's completions `logprobs` is the number of alternatives (0 = the chosen token only).
        logprobs=request.logprobs is not None,
        top_logprobs=request.logprobs or 0,
        echo=request.echo,
        prompt_logprobs=request.scores_prompt(),
        kv_cache=request.kv_cache or "",
    )
    if request.speculative is not None:
        generate.speculative = request.speculative
    if (text := request.prompt_text()) is not None:
        generate.prompt = text
    else:
        generate.token_ids.ids.extend(request.prompt_token_ids())
    return generate


def build_chat_requests(
    request: ChatCompletionRequest, request_id: str, images: Images | None = None
) -> list[core_pb2.GenerateRequest]:
    """One GenerateRequest per choice (`n`; choices.py)."""
    parts = one_per_choice([request], request.n)
    return _per_choice(parts, request_id, lambda part, rid: build_chat_request(part, rid, images))


def build_completion_requests(request: CompletionRequest, request_id: str) -> list[core_pb2.GenerateRequest]:
    """One GenerateRequest per choice: per prompt of a batch, `n` each (choices.py)."""
    parts = one_per_choice(request.one_per_prompt(), request.n)
    return _per_choice(parts, request_id, build_completion_request)


def _per_choice(parts: list, request_id: str, build) -> list[core_pb2.GenerateRequest]:
    """Each part built; several get request ids of their own (`<id>-<choice>`) for core's logs."""
    if len(parts) == 1:
        return [build(parts[0], request_id)]
    return [build(part, f"{request_id}-{i}") for i, part in enumerate(parts)]
