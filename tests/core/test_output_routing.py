"""Reasoning and tool-call routing on the real Qwen3 tokenizer, fed the exact tokens a Qwen3 model emits.

Random weights never write `<think>` or `<tool_call>`, so these tests tokenize the text a
real Qwen3 writes and stream it token by token through the same preparer and emitter
the engine uses.
"""

from __future__ import annotations

import json

import grpc
import pytest
from mlx_lm.tokenizer_utils import load

from services.core.request_prep import RequestError, RequestPreparer
from services.core.text_output import TextEmitter
from services.proto.moemesh.v1 import core_pb2
from services.tools.synthetic_model import qwen3_tokenizer_dir

VOCAB = 151936
WEATHER = core_pb2.Tool(
    name="get_weather",
    description="Current weather in a city",
    parameters_json=json.dumps(
        {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    ),
)
TIME = core_pb2.Tool(name="get_time", parameters_json='{"type": "object", "properties": {}}')
Mode = core_pb2.ToolChoice.Mode


@pytest.fixture(scope="module")
def tokenizer():
    return load(qwen3_tokenizer_dir())


@pytest.fixture(scope="module")
def preparer(tokenizer):
    return RequestPreparer(tokenizer, "tiny", 4096, VOCAB)


def chat_request(tools=(WEATHER, TIME), mode=Mode.AUTO, name="", **fields) -> core_pb2.GenerateRequest:
    return core_pb2.GenerateRequest(
        chat=core_pb2.ChatInput(
            messages=[core_pb2.ChatMessage(role="user", content="Weather in Paris?")],
            tools=list(tools),
            tool_choice=core_pb2.ToolChoice(mode=mode, function_name=name),
        ),
        **fields,
    )


def stream(preparer, tokenizer, request, model_text: str, end_with_eos: bool = True):
    """Run `model_text` (as a Qwen3 model would emit it) through the engine's emitter.
    Returns (chunks, finish_reason): one merged GenerateChunk per token."""
    prepared = preparer.prepare(request, None)
    emitter = TextEmitter(tokenizer.detokenizer, prepared.output)
    chunks = []
    for token in tokenizer.encode(model_text, add_special_tokens=False):
        chunk = core_pb2.GenerateChunk()
        emitter.add(token).write_to(chunk)
        chunks.append(chunk)
        if emitter.stopped:
            break
    final = core_pb2.GenerateChunk()
    emitter.finish().write_to(final)
    chunks.append(final)
    reason = core_pb2.FinishReason.STOP if end_with_eos or emitter.stopped else core_pb2.FinishReason.LENGTH
    return chunks, emitter.finish_reason(reason)


def joined(chunks, name):
    return "".join(getattr(c, name) for c in chunks)


def calls(chunks):
    return [call for c in chunks for call in c.tool_calls]


def test_qwen3_markers_are_known(tokenizer):
    assert (tokenizer.think_start, tokenizer.think_end) == ("<think>", "</think>")
    assert (tokenizer.tool_call_start, tokenizer.tool_call_end) == ("<tool_call>", "</tool_call>")


def test_thinking_then_tool_call_streams_reasoning_and_one_parsed_call(preparer, tokenizer):
    text = (
        "<think>\nThe user wants the weather in Paris. I should call get_weather.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    chunks, reason = stream(preparer, tokenizer, chat_request(), text)
    assert (
        joined(chunks, "reasoning") == "\nThe user wants the weather in Paris. I should call get_weather.\n"
    )
    assert joined(chunks, "text") == ""
    (call,) = calls(chunks)
    assert (call.index, call.name, json.loads(call.arguments)) == (0, "get_weather", {"city": "Paris"})
    assert call.id.startswith("call_") and len(call.id) > 10
    assert reason == core_pb2.FinishReason.TOOL_CALLS
    # The call arrives whole, in the chunk of the token that closed it, and nothing of it as text.
    assert [i for i, c in enumerate(chunks) if c.tool_calls] == [len(chunks) - 2]


def test_two_parallel_calls_get_indexes_and_the_newline_between_them_is_not_content(preparer, tokenizer):
    text = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    chunks, reason = stream(preparer, tokenizer, chat_request(), text)
    assert [(c.index, c.name, c.arguments) for c in calls(chunks)] == [
        (0, "get_weather", '{"city": "Paris"}'),
        (1, "get_time", "{}"),
    ]
    assert joined(chunks, "text") == ""
    assert len({c.id for c in calls(chunks)}) == 2
    assert reason == core_pb2.FinishReason.TOOL_CALLS


def test_content_before_a_tool_call_is_streamed_and_the_call_held_back(preparer, tokenizer):
    text = (
        'Let me check that for you.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
        "\n</tool_call>"
    )
    chunks, reason = stream(preparer, tokenizer, chat_request(), text)
    assert joined(chunks, "text") == "Let me check that for you.\n"
    assert "<tool" not in joined(chunks, "text")
    assert [c.name for c in calls(chunks)] == ["get_weather"]
    assert reason == core_pb2.FinishReason.TOOL_CALLS


def test_a_tool_call_that_does_not_parse_is_returned_as_text(preparer, tokenizer):
    text = "<tool_call>\nnot json at all\n</tool_call>"
    chunks, reason = stream(preparer, tokenizer, chat_request(), text)
    assert calls(chunks) == []
    assert joined(chunks, "text") == text
    assert reason == core_pb2.FinishReason.STOP


def test_a_tool_call_cut_by_max_tokens_is_not_a_call(preparer, tokenizer):
    text = '<tool_call>\n{"name": "get_weather", "argu'
    chunks, reason = stream(preparer, tokenizer, chat_request(), text, end_with_eos=False)
    assert calls(chunks) == []
    assert joined(chunks, "text") == text
    assert reason == core_pb2.FinishReason.LENGTH


def test_without_tools_tool_call_text_is_plain_content(preparer, tokenizer):
    text = '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    chunks, _ = stream(preparer, tokenizer, chat_request(tools=()), text)
    assert calls(chunks) == [] and joined(chunks, "text") == text


def test_tool_choice_none_hides_the_tools_from_the_template_and_parses_nothing(preparer, tokenizer):
    with_tools = preparer.prompt_tokens(chat_request())
    hidden = preparer.prompt_tokens(chat_request(mode=Mode.NONE))
    assert "get_weather" in tokenizer.decode(with_tools)
    assert "get_weather" not in tokenizer.decode(hidden)
    text = '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    chunks, reason = stream(preparer, tokenizer, chat_request(mode=Mode.NONE), text)
    assert calls(chunks) == [] and reason == core_pb2.FinishReason.STOP


def test_thinking_then_answer_keeps_the_answer_clean(preparer, tokenizer):
    text = "<think>\nParis is in France.\n</think>\n\nIt is sunny in Paris."
    chunks, reason = stream(preparer, tokenizer, chat_request(tools=()), text)
    assert joined(chunks, "reasoning") == "\nParis is in France.\n"
    assert joined(chunks, "text") == "It is sunny in Paris."
    assert reason == core_pb2.FinishReason.STOP
    assert not any(c.text and c.reasoning for c in chunks[:3])


def test_prompt_that_opens_the_think_block_starts_in_reasoning(preparer, tokenizer):
    """Templates like Qwen3-Thinking-2507 end the prompt with `<think>\\n`: the model's
    first tokens are thinking, and only `</think>` comes out."""
    prompt = tokenizer.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n")
    request = core_pb2.GenerateRequest(token_ids=core_pb2.TokenIds(ids=prompt))
    chunks, _ = stream(preparer, tokenizer, request, "The user greets me.\n</think>\n\nHello!")
    assert joined(chunks, "reasoning") == "The user greets me.\n"
    assert joined(chunks, "text") == "Hello!"


def test_thinking_disabled_in_the_template_is_not_reasoning(preparer, tokenizer):
    request = chat_request(tools=())
    request.chat.template_kwargs_json = '{"enable_thinking": false}'
    prompt_text = tokenizer.decode(preparer.prompt_tokens(request))
    assert prompt_text.endswith("<think>\n\n</think>\n\n")  # the closed, empty block Qwen3 writes
    chunks, _ = stream(preparer, tokenizer, request, "Hello there!")
    assert joined(chunks, "text") == "Hello there!" and joined(chunks, "reasoning") == ""


def test_stop_strings_cut_content_but_not_reasoning(preparer, tokenizer):
    request = chat_request(tools=(), stopping=core_pb2.StoppingCriteria(stop=["END"]))
    chunks, reason = stream(
        preparer, tokenizer, request, "<think>\nnot the END yet\n</think>\n\nDone. END more"
    )
    assert joined(chunks, "reasoning") == "\nnot the END yet\n"
    assert joined(chunks, "text") == "Done. "
    assert reason == core_pb2.FinishReason.STOP
    assert chunks[-1].matched_stop == "END"  # Anthropic's stop_sequence


def test_no_matched_stop_when_the_output_ends_otherwise(preparer, tokenizer):
    request = chat_request(tools=(), stopping=core_pb2.StoppingCriteria(stop=["END"]))
    chunks, _ = stream(preparer, tokenizer, request, "All done.")
    assert chunks[-1].matched_stop == ""


def test_echo_sends_the_prompt_first(preparer, tokenizer):
    request = core_pb2.GenerateRequest(prompt="Once upon a time", echo=True)
    chunks, _ = stream(preparer, tokenizer, request, " there was")
    assert chunks[0].text.startswith("Once upon a time")
    assert joined(chunks, "text") == "Once upon a time there was"
    ids = tokenizer.encode("Hello world")
    request = core_pb2.GenerateRequest(token_ids=core_pb2.TokenIds(ids=ids), echo=True)
    chunks, _ = stream(preparer, tokenizer, request, "!")
    assert joined(chunks, "text") == "Hello world!"


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (chat_request(mode=Mode.NAMED, name="get_stock"), "tool_choice.function_name"),
        (chat_request(tools=(), mode=Mode.REQUIRED), "tool_choice"),
        (chat_request(mode=7), "tool_choice.mode"),
        (chat_request(tools=(WEATHER, WEATHER)), "chat.tools[1].name"),
        (chat_request(tools=(core_pb2.Tool(name="bad name!"),)), "chat.tools[0].name"),
        (
            chat_request(tools=(core_pb2.Tool(name="f", parameters_json="{oops"),)),
            "chat.tools[0].parameters_json",
        ),
        (
            chat_request(
                mode=Mode.REQUIRED,
                response_format=core_pb2.ResponseFormat(type=core_pb2.ResponseFormat.JSON_OBJECT),
            ),
            "response_format",
        ),
        (
            core_pb2.GenerateRequest(
                prompt="x",
                response_format=core_pb2.ResponseFormat(
                    type=core_pb2.ResponseFormat.JSON_SCHEMA, schema_json="{"
                ),
            ),
            "response_format.schema_json",
        ),
        (
            core_pb2.GenerateRequest(
                prompt="x", response_format=core_pb2.ResponseFormat(type=core_pb2.ResponseFormat.JSON_SCHEMA)
            ),
            "response_format.schema_json",
        ),
        (
            core_pb2.GenerateRequest(
                prompt="x",
                response_format=core_pb2.ResponseFormat(
                    type=core_pb2.ResponseFormat.JSON_SCHEMA,
                    schema_json='{"type": "object", "properties": {"a": {"type": "nonsense"}}}',
                ),
            ),
            "response_format",
        ),
        (
            core_pb2.GenerateRequest(prompt="x", sampling=core_pb2.SamplingParams(logit_bias={5: 101})),
            "logit_bias",
        ),
        (
            core_pb2.GenerateRequest(prompt="x", sampling=core_pb2.SamplingParams(logit_bias={5: -100.5})),
            "logit_bias",
        ),
        (
            core_pb2.GenerateRequest(prompt="x", sampling=core_pb2.SamplingParams(logit_bias={VOCAB: 1})),
            "logit_bias: token id 151936",
        ),
        (
            core_pb2.GenerateRequest(
                prompt="x", stopping=core_pb2.StoppingCriteria(stop_token_ids=[VOCAB + 5])
            ),
            "stop_token_ids",
        ),
        (core_pb2.GenerateRequest(token_ids=core_pb2.TokenIds(ids=[1, VOCAB])), "token_ids"),
        (
            core_pb2.GenerateRequest(
                chat=core_pb2.ChatInput(
                    messages=[core_pb2.ChatMessage(role="user", content="x")],
                    template_kwargs_json='{"tools": 5}',
                )
            ),
            "chat.template_kwargs_json: tools cannot be set here",
        ),
        (
            core_pb2.GenerateRequest(
                chat=core_pb2.ChatInput(
                    messages=[core_pb2.ChatMessage(role="user", content="x")], template_kwargs_json="[1]"
                )
            ),
            "chat.template_kwargs_json: must be a JSON object",
        ),
    ],
)
def test_bad_requests_are_invalid_argument_naming_the_field(preparer, request_, field):
    with pytest.raises(RequestError) as error:
        preparer.prepare(request_, None)
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert field in str(error.value), str(error.value)


def test_tools_for_a_model_without_a_tool_call_format_are_refused_unless_hidden(
    preparer, tokenizer, monkeypatch
):
    """A template without tools drops them, a model without markers cannot call them: a client
    that offers tools learns so (vLLM too), and tool_choice none (tools never shown) still works."""
    monkeypatch.setattr(type(tokenizer), "has_tool_calling", property(lambda self: False))
    with pytest.raises(RequestError) as error:
        preparer.prepare(chat_request(), None)
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert str(error.value).startswith("chat.tools: this model has no tool-call format")
    assert preparer.prepare(chat_request(mode=Mode.NONE), None).output.tool_calls is None


def test_logit_bias_at_the_limits_is_accepted(preparer):
    request = core_pb2.GenerateRequest(
        prompt="x", sampling=core_pb2.SamplingParams(logit_bias={5: 100, 6: -100})
    )
    assert len(preparer.prepare(request, None).processors) == 1


def test_grammar_waits_until_the_model_closes_the_thinking_the_prompt_opened(preparer, tokenizer):
    import mlx.core as mx

    prompt = tokenizer.encode("<|im_start|>user\nJSON please<|im_end|>\n<|im_start|>assistant\n<think>\n")
    request = core_pb2.GenerateRequest(
        token_ids=core_pb2.TokenIds(ids=prompt),
        response_format=core_pb2.ResponseFormat(type=core_pb2.ResponseFormat.JSON_OBJECT),
    )
    prepared = preparer.prepare(request, None)
    (constraint,) = prepared.processors
    logits = mx.zeros((1, VOCAB))
    hello, brace = tokenizer.encode("Hello", add_special_tokens=False)[0], tokenizer.encode("{")[0]
    context = list(prompt)
    assert mx.all(constraint(mx.array(context), logits) == 0).item()  # thinking: free
    context += tokenizer.encode("I will write JSON.", add_special_tokens=False)
    assert mx.all(constraint(mx.array(context), logits) == 0).item()
    context += tokenizer.encode("</think>", add_special_tokens=False)
    masked = constraint(mx.array(context), logits)
    assert masked[0, brace].item() == 0 and masked[0, hello].item() <= -1e29


def test_other_mlx_lm_tool_formats_parse_through_the_same_emitter(tokenizer):
    """Qwen3-Coder writes XML-style calls; mlx-lm's qwen3_coder parser reads them."""
    from mlx_lm.tool_parsers import qwen3_coder

    from services.core.text_output import OutputSpec, ToolCallFormat

    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                },
            },
        }
    ]
    spec = OutputSpec(
        tool_calls=ToolCallFormat(
            qwen3_coder.tool_call_start, qwen3_coder.tool_call_end, qwen3_coder.parse_tool_call, tools
        )
    )
    emitter = TextEmitter(tokenizer.detokenizer, spec)
    text = (
        "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    )
    chunks = []
    for token in tokenizer.encode(text, add_special_tokens=False):
        chunk = core_pb2.GenerateChunk()
        emitter.add(token).write_to(chunk)
        chunks.append(chunk)
    final = core_pb2.GenerateChunk()
    emitter.finish().write_to(final)
    chunks.append(final)
    (call,) = calls(chunks)
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris", "days": 3})
    assert joined(chunks, "text") == "Checking.\n"
    assert emitter.finish_reason(core_pb2.FinishReason.STOP) == core_pb2.FinishReason.TOOL_CALLS


def test_control_tokens_never_reach_the_text(preparer, tokenizer):
    """Special tokens the model samples (forced by a logit bias, or a confused model) are left out of
    the answer, as vLLM's skip_special_tokens does; the markers the router reads stay."""
    text = "Hello<|endoftext|><|im_start|> world<|object_ref_start|>!"
    assert tokenizer.encode("<|im_start|>", add_special_tokens=False) == [151644]  # one special token
    chunks, _ = stream(preparer, tokenizer, chat_request(tools=()), text)
    assert joined(chunks, "text") == "Hello world!"
    thought, _ = stream(
        preparer, tokenizer, chat_request(tools=()), "<think>\nhm\n</think>\n\nYes<|im_start|>"
    )
    assert (joined(thought, "reasoning"), joined(thought, "text")) == ("\nhm\n", "Yes")


def test_a_character_cut_off_by_the_token_limit_is_not_sent_as_a_replacement_character(preparer, tokenizer):
    """🫠 is three byte-level tokens in Qwen3's vocabulary: stopping after two leaves half a character."""
    request = core_pb2.GenerateRequest(
        chat=core_pb2.ChatInput(messages=[core_pb2.ChatMessage(role="user", content="hi")])
    )
    prepared = preparer.prepare(request, None)
    tokens = tokenizer.encode("Hi 🫠", add_special_tokens=False)
    emitter = TextEmitter(tokenizer.detokenizer, prepared.output)
    chunk = core_pb2.GenerateChunk()
    for token in tokens[:-1]:
        emitter.add(token).write_to(chunk)
    emitter.finish().write_to(chunk)
    assert chunk.text == "Hi "
    whole = TextEmitter(tokenizer.detokenizer, prepared.output)
    chunk = core_pb2.GenerateChunk()
    for token in tokens:
        whole.add(token).write_to(chunk)
    whole.finish().write_to(chunk)
    assert chunk.text == "Hi 🫠"
