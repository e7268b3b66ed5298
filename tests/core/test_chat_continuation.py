"""A final assistant turn continued, not answered anew (Anthropic's prefill, vLLM's
continue_final_message): the prompt ends with that turn's text, rendered by the model's own chat
template, whichever tokenizer wrapper serves it."""

from __future__ import annotations

import grpc
import pytest
from mlx_lm.tokenizer_utils import load

from services.core.request_prep import RequestError, RequestPreparer
from services.proto.moemesh.v1 import core_pb2
from services.tools.synthetic_model import qwen3_tokenizer_dir

PREFILL = "The capital of France is"


@pytest.fixture(scope="module")
def tokenizer():
    return load(qwen3_tokenizer_dir())


@pytest.fixture(scope="module")
def preparer(tokenizer):
    return RequestPreparer(tokenizer, "tiny", 4096, 151936)


def chat(*turns: tuple[str, str], continue_final: bool) -> core_pb2.GenerateRequest:
    return core_pb2.GenerateRequest(
        chat=core_pb2.ChatInput(
            messages=[core_pb2.ChatMessage(role=role, content=text) for role, text in turns],
            continue_final_message=continue_final,
        )
    )


def test_the_prompt_ends_with_the_final_assistant_text(preparer, tokenizer):
    request = chat(("user", "What is the capital of France?"), ("assistant", PREFILL), continue_final=True)
    prompt = preparer.prompt_tokens(request)
    text = tokenizer.decode(prompt)
    assert text.endswith(PREFILL)  # no end-of-turn, no new assistant header after it
    assert text.count("<|im_start|>assistant") == 1
    opened = preparer.prompt_tokens(chat(("user", "What is the capital of France?"), continue_final=False))
    assert prompt[: len(opened)] == opened  # the same conversation, then the prefill
    assert preparer.prepare(request, None).prompt == prompt


def test_without_the_flag_a_final_assistant_turn_is_closed_and_a_new_one_opened(preparer, tokenizer):
    request = chat(("user", "What is the capital of France?"), ("assistant", PREFILL), continue_final=False)
    text = tokenizer.decode(preparer.prompt_tokens(request))
    assert text.count("<|im_start|>assistant") == 2 and not text.endswith(PREFILL)


def test_an_empty_prefill_opens_the_turn(preparer):
    continued = chat(("user", "Hi"), ("assistant", "  "), continue_final=True)
    assert preparer.prompt_tokens(continued) == preparer.prompt_tokens(
        chat(("user", "Hi"), continue_final=False)
    )


def test_continuing_a_user_turn_is_refused(preparer):
    with pytest.raises(RequestError) as caught:
        preparer.prompt_tokens(chat(("user", "Hi"), continue_final=True))
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT and "assistant" in str(caught.value)


def test_an_assistant_turn_that_calls_tools_cannot_be_continued(preparer):
    request = chat(("user", "Weather?"), ("assistant", "Let me check."), continue_final=True)
    request.chat.messages[-1].tool_calls.add(id="c1", name="get_weather", arguments="{}")
    with pytest.raises(RequestError) as caught:
        preparer.prompt_tokens(request)
    assert "tools" in str(caught.value)


def test_trailing_space_the_template_keeps_is_kept(preparer, tokenizer):
    request = chat(("user", "Finish: one, two,"), ("assistant", "one, two, "), continue_final=True)
    assert tokenizer.decode(preparer.prompt_tokens(request)).endswith("one, two, ")
