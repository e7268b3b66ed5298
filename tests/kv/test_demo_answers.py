"""The demo model's greedy answers with TurboQuant caches against fp16's.

Six chat prompts put ~3,000 characters of license text before a question (answers.QUESTIONS);
at the default setting ~550 of each prompt's ~690 tokens are compressed. Every answer must be
fp16's, or leave it only where fp16 itself was nearly undecided (answers.departure: its token
led by < 0.5 nats). Plain equality is not the bar because near ties flip under any lossy cache,
mlx-lm's own 8-bit one included (see answers.py); a broken or too coarse cache fails here
(K2+QJL/V2 departs at leads of 0.85 and 1.6 nats).

Real weights, real tokenizer and chat template, the cache as core uses it (prefix prefilled
once and copied per request). fp16's answers are computed once for both settings.
"""

from __future__ import annotations

import mlx_lm
import pytest

from services.core.kv import PAPER_SETTINGS, KVCacheSettings, make_kv_cache
from services.tools.kv_answers import (
    QUESTIONS,
    departure,
    greedy_answer,
    is_near_tie,
    prefill,
    question_prompts,
    shared_prefix_length,
)
from services.tools.kv_quality import ensure_dense_demo_model

pytestmark = pytest.mark.slow  # starts processes or computes for seconds

ANSWER_TOKENS = 24


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    model, tokenizer = mlx_lm.load(str(ensure_dense_demo_model(tmp_path_factory.mktemp("demo"))))
    try:  # core's CPU kernel for the quantized projections: same numbers, several times faster
        from metal.linear_cpu import use_cpu_kernels

        use_cpu_kernels(model, heads_at_few_positions_only=False)
    except ImportError:
        pass
    return model, tokenizer


@pytest.fixture(scope="module")
def fp16_answers(demo):
    """(prompts, shared prefix length, {question: (fp16's tokens, their log-probs)}): the oracle,
    computed once for every setting below."""
    model, tokenizer = demo
    prompts = question_prompts(tokenizer)
    shared = shared_prefix_length(prompts)
    fp16 = prefill(model, prompts[0][:shared], make_kv_cache(model, "fp16"))
    eos = tokenizer.eos_token_ids
    answers = {
        question: greedy_answer(model, prompt[shared:], fp16, ANSWER_TOKENS, eos)
        for question, prompt in zip(QUESTIONS, prompts, strict=True)
    }
    return prompts, shared, answers


@pytest.mark.parametrize(
    "settings",
    [KVCacheSettings(), PAPER_SETTINGS],
    ids=["default K4/V3", "the paper's K3+QJL/V3"],
)
def test_turboquant_answers_are_fp16s_except_at_near_ties(demo, fp16_answers, settings):
    model, tokenizer = demo
    prompts, shared, fp16 = fp16_answers
    assert shared > settings.sink_tokens + settings.recent_window + 400  # most of each prompt compressed
    turboquant = prefill(model, prompts[0][:shared], make_kv_cache(model, "turboquant", settings))
    assert sum(c.compressed_length for c in turboquant) > 0

    eos, results = tokenizer.eos_token_ids, {}
    for question, prompt in zip(QUESTIONS, prompts, strict=True):
        reference, logprobs = fp16[question]
        answer, _ = greedy_answer(model, prompt[shared:], turboquant, ANSWER_TOKENS, eos)
        results[question] = (
            departure(reference, logprobs, answer),
            tokenizer.decode(reference),
            tokenizer.decode(answer),
        )

    assert "Paris" in results["What is the capital of France?"][1]  # the oracle itself answers sensibly
    moved = {q: r for q, r in results.items() if not is_near_tie(r[0])}
    assert not moved, f"answers left fp16's where fp16 was sure: {moved}"
