"""`/v1/completions` through the official `openai` client, against the Core double."""

from __future__ import annotations

import time

import grpc
import openai
import pytest

from .core_double import ANSWER, ANSWER_WORDS, MODEL_ID, CoreDouble, Script, prompt_logprobs
from .test_gateway_openai_client import async_client, sync_client

PROMPT = "Question: what is the capital of France? Answer:"


def test_string_prompt(gateway_url: str, core: CoreDouble) -> None:
    completion = sync_client(gateway_url).completions.create(
        model=MODEL_ID, prompt=PROMPT, stop=["\n"], seed=3
    )
    assert completion.object == "text_completion" and completion.id.startswith("cmpl-")
    assert completion.choices[0].text == ANSWER and completion.choices[0].finish_reason == "stop"
    assert completion.usage.prompt_tokens == len(PROMPT.split()) and completion.usage.completion_tokens == 7
    sent = core.requests[0]
    assert sent.WhichOneof("input") == "prompt" and sent.prompt == PROMPT
    assert list(sent.stopping.stop) == ["\n"] and sent.sampling.seed == 3
    assert sent.stopping.max_tokens == 16  # OpenAI's default for completions
    assert not sent.echo and not sent.logprobs


@pytest.mark.parametrize("prompt", [[101, 102, 103], [[101, 102, 103]]])
def test_token_id_prompt(gateway_url: str, core: CoreDouble, prompt) -> None:
    completion = sync_client(gateway_url).completions.create(model=MODEL_ID, prompt=prompt, max_tokens=3)
    assert completion.choices[0].text == "The capital of" and completion.choices[0].finish_reason == "length"
    assert list(core.requests[0].token_ids.ids) == [101, 102, 103]
    assert completion.usage.prompt_tokens == 3


@pytest.mark.parametrize("prompts", [["a b", "c d e", "f"], [[101, 102], [7, 8, 9]]])
def test_a_batch_of_prompts_gets_a_choice_each(gateway_url: str, core: CoreDouble, prompts) -> None:
    completion = sync_client(gateway_url).completions.create(
        model=MODEL_ID, prompt=prompts, echo=True, logprobs=1, max_tokens=3
    )
    assert [choice.index for choice in completion.choices] == list(range(len(prompts)))
    sent = sorted(core.requests, key=lambda r: r.request_id)
    assert [r.prompt if r.prompt else list(r.token_ids.ids) for r in sent] == prompts
    assert len({r.request_id for r in sent}) == len(prompts)
    for prompt, choice in zip(prompts, completion.choices, strict=True):
        if isinstance(prompt, str):  # echoed: each choice answers its own prompt
            assert choice.text == prompt + "The capital of"
        assert choice.logprobs.tokens[-3:] == ANSWER_WORDS[:3]
    words = [len(p.split()) if isinstance(p, str) else len(p) for p in prompts]
    assert completion.usage.prompt_tokens == sum(words)
    assert completion.usage.completion_tokens == 3 * len(prompts)
    assert completion.usage.total_tokens == sum(words) + 3 * len(prompts)


def test_a_batch_with_n_gives_n_choices_per_prompt_in_order(gateway_url: str, core: CoreDouble) -> None:
    completion = sync_client(gateway_url).completions.create(
        model=MODEL_ID, prompt=["a b", "c"], n=2, seed=5, echo=True, max_tokens=2
    )
    assert [(c.index, c.text) for c in completion.choices] == [
        (0, "a bThe capital"),
        (1, "a bThe capital"),
        (2, "cThe capital"),
        (3, "cThe capital"),
    ]
    sent = sorted((r.prompt, r.sampling.seed) for r in core.requests)
    assert sent == [("a b", 5), ("a b", 6), ("c", 5), ("c", 6)]
    assert completion.usage.prompt_tokens == 3 and completion.usage.completion_tokens == 8


def test_a_streamed_batch_interleaves_its_choices(gateway_url: str, core: CoreDouble) -> None:
    stream = sync_client(gateway_url).completions.create(
        model=MODEL_ID,
        prompt=["a b", "c"],
        n=2,
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    usages = []
    for chunk in stream:
        if chunk.usage is not None:
            usages.append(chunk.usage)
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert texts == {i: "The capital of" for i in range(4)}
    assert finishes == {i: "length" for i in range(4)}
    assert len(usages) == 1  # one usage chunk, last, for the whole answer
    assert (usages[0].prompt_tokens, usages[0].completion_tokens) == (3, 12)


def test_a_batch_fails_whole_when_a_prompt_fails(gateway_url: str, core: CoreDouble) -> None:
    core.script = Script(
        abort_code=grpc.StatusCode.INVALID_ARGUMENT, abort_message="kv_cache: unknown kind 'x'"
    )
    with pytest.raises(openai.BadRequestError) as raised:
        sync_client(gateway_url).completions.create(model=MODEL_ID, prompt=["a", "b", "c"])
    assert raised.value.body["param"] == "kv_cache"
    deadline = time.monotonic() + 5
    while core.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert core.running == 0  # every call ended: none left generating for nobody


def test_echo_and_logprobs(gateway_url: str, core: CoreDouble) -> None:
    completion = sync_client(gateway_url).completions.create(
        model=MODEL_ID, prompt=PROMPT, echo=True, logprobs=1, max_tokens=50
    )
    choice = completion.choices[0]
    assert choice.text == PROMPT + ANSWER
    # the prompt's own tokens first, scored (the first has nothing before it), then the answer's
    prompt_words = [word.token for word in prompt_logprobs(core.requests[0])]
    assert choice.logprobs.tokens == prompt_words + ANSWER_WORDS
    assert choice.logprobs.token_logprobs == [None] + [-1.0] * (len(prompt_words) - 1) + [-0.5] * 7
    assert choice.logprobs.top_logprobs[0] is None
    assert choice.logprobs.top_logprobs[1] == {" what": -1.0}
    assert choice.logprobs.top_logprobs[len(prompt_words)] == {"The": pytest.approx(-0.5)}
    offsets = choice.logprobs.text_offset
    tokens = choice.logprobs.tokens
    assert [
        choice.text[offset : offset + len(token)] for offset, token in zip(offsets, tokens, strict=True)
    ] == tokens
    sent = core.requests[0]
    assert sent.echo and sent.logprobs and sent.top_logprobs == 1 and sent.prompt_logprobs


def test_logprobs_zero_still_gives_the_chosen_token(gateway_url: str, core: CoreDouble) -> None:
    """OpenAI's legacy API always returns the chosen token's logprob, so `logprobs: 0` gives maps of
    one entry (vLLM alike), and `logprobs: n` up to n + 1."""
    completion = sync_client(gateway_url).completions.create(
        model=MODEL_ID, prompt=PROMPT, logprobs=0, max_tokens=3
    )
    logprobs = completion.choices[0].logprobs
    assert logprobs.top_logprobs == [{token: -0.5} for token in logprobs.tokens] and len(logprobs.tokens) == 3
    assert core.requests[0].logprobs and core.requests[0].top_logprobs == 0


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_zero_scores_the_prompt_alone(
    gateway_url: str, core: CoreDouble, stream
) -> None:
    """OpenAI's older way to score a text: echo the prompt with its logprobs, generate nothing."""
    request = dict(model=MODEL_ID, prompt=PROMPT, echo=True, logprobs=0, max_tokens=0)
    if stream:
        chunks = [c for c in sync_client(gateway_url).completions.create(**request, stream=True) if c.choices]
        text = "".join(c.choices[0].text for c in chunks)
        logprobs = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
        assert len(logprobs) == 1
        tokens, token_logprobs, offsets = (
            logprobs[0].tokens,
            logprobs[0].token_logprobs,
            logprobs[0].text_offset,
        )
        assert chunks[-1].choices[0].finish_reason == "length"
    else:
        choice = sync_client(gateway_url).completions.create(**request).choices[0]
        text, tokens, token_logprobs = choice.text, choice.logprobs.tokens, choice.logprobs.token_logprobs
        offsets = choice.logprobs.text_offset
        assert choice.finish_reason == "length"
    assert text == PROMPT and "".join(tokens) == PROMPT
    assert token_logprobs == [None] + [-1.0] * (len(tokens) - 1)
    assert offsets == [PROMPT.index(token.strip()) - (token != tokens[0]) for token in tokens]
    sent = core.requests[0]
    assert sent.prompt_logprobs and sent.stopping.max_tokens == 0


def test_max_tokens_zero_needs_echo(gateway_url: str, core: CoreDouble) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        sync_client(gateway_url).completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=0)
    assert raised.value.body["param"] == "max_tokens"
    assert core.requests == []


def test_stream_with_usage_and_logprobs(gateway_url: str, core: CoreDouble) -> None:
    stream = sync_client(gateway_url).completions.create(
        model=MODEL_ID, prompt=PROMPT, stream=True, logprobs=0, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ANSWER
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == ANSWER_WORDS
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "stop"
    ]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7


async def test_async_stream(gateway_url: str, core: CoreDouble) -> None:
    client = async_client(gateway_url)
    stream = await client.completions.create(model=MODEL_ID, prompt=PROMPT, stream=True)
    text = "".join([chunk.choices[0].text async for chunk in stream])
    await client.close()
    assert text == ANSWER


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": ["a", ""]}, "prompt"),
        ({"prompt": ["a"] * 257}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": PROMPT, "best_of": 3}, "best_of"),
        ({"prompt": PROMPT, "suffix": "x"}, "suffix"),
        ({"prompt": PROMPT, "logprobs": 99}, "logprobs"),
        ({"prompt": ["a"] * 100, "n": 3}, "n"),
        ({"prompt": [-1]}, "prompt"),
    ],
)
def test_invalid_is_400(gateway_url: str, core: CoreDouble, fields, param) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        sync_client(gateway_url).completions.create(model=MODEL_ID, **fields)
    assert (raised.value.body["param"] or "").startswith(param), raised.value.body
    assert core.requests == []


# 日本🚀 as a byte-level BPE model writes it: 日 whole, 本 in two tokens, 🚀 in three
SPLIT_CHARACTERS = [b"\xe6\x97\xa5", b"\xe6\x9c", b"\xac", b"\xf0\x9f", b"\x9a", b"\x80", b" ok"]


@pytest.mark.parametrize("stream", [False, True])
def test_text_offsets_index_the_text_when_tokens_split_characters(
    gateway_url: str, core: CoreDouble, stream
) -> None:
    core.script.token_bytes = SPLIT_CHARACTERS
    request = dict(model=MODEL_ID, prompt=PROMPT, echo=True, logprobs=0, max_tokens=50)
    if stream:
        chunks = list(sync_client(gateway_url).completions.create(**request, stream=True))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        offsets = [
            o
            for c in chunks
            if c.choices and c.choices[0].logprobs
            for o in c.choices[0].logprobs.text_offset
        ]
    else:
        choice = sync_client(gateway_url).completions.create(**request).choices[0]
        text, offsets = choice.text, choice.logprobs.text_offset
    assert text == PROMPT + "日本🚀 ok"
    start = len(PROMPT)
    # each token's offset is where the character it begins or continues sits in the text (after
    # the prompt's own tokens)
    assert offsets[-7:] == [start, start + 1, start + 1, start + 2, start + 2, start + 2, start + 3]
    assert text[offsets[-1] :] == " ok"


def test_prompt_offsets_hold_when_token_bytes_carry_more_than_the_echo() -> None:
    """SentencePiece prompt tokens carry a leading space the echoed prompt does not have: offsets
    are counted back from the end of the echo, so each token still points at its own text."""
    from services.gateway.completions_format import LegacyLogprobs, _logprobs_of
    from services.proto.moemesh.v1 import core_pb2

    def entry(text: str) -> core_pb2.TokenLogprob:
        return core_pb2.TokenLogprob(token=text, token_bytes=text.encode(), logprob=-1.0)

    text = "the quick fox"
    part = _logprobs_of(LegacyLogprobs(), [entry(" the"), entry(" quick")], [entry(" fox")], text)
    assert part["text_offset"] == [0, 3, 9]
    assert text[3:9] == " quick" and text[9:] == " fox"
    assert part["token_logprobs"] == [None, -1.0, -1.0]
