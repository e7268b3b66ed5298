"""Greedy answers under a KV cache compared with fp16's: the fixed prompt set and the rule.

Each prompt puts ~3,000 characters of the bundled GPL-3 text before a short question, so that
at the default window (4 sinks + 128 recent tokens) ~550 of its ~690 tokens are compressed.

The rule (`departure`): an answer is fp16's, or where it first leaves fp16's answer, fp16 itself
was nearly undecided — its own token led the one taken by less than NEAR_TIE_NATS of log
probability. Why not plain equality: any lossy cache moves the logits a little (even mlx-lm's
8-bit KV cache), and on the 135M demo model fp16's lead at a departure point is often a few
hundredths of a nat, so a sound cache may leave an answer where fp16 was nearly undecided. A
broken or too coarse cache departs where fp16 was sure. `lead_shifts` measures how far a cache
moves fp16's leads (figures: docs/benchmarks.md, TurboQuant quality).
"""

from __future__ import annotations

import copy
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step

TEXT = Path(__file__).resolve().parents[2] / "tests" / "assets" / "gpl-3.0.txt"
CONTEXT_CHARS = 3000
QUESTIONS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 12 times 12?",
    "Who wrote Romeo and Juliet?",
    "What gas do plants absorb from the air?",
    "Summarize the license text above in one sentence.",
)
# a larger sample after the same text (bench/kv_quality.py --more-questions)
MORE_QUESTIONS = (
    "What is the largest planet in our solar system?",
    "How many days are there in a week?",
    "What is the boiling point of water in degrees Celsius?",
    "What is the chemical symbol for gold?",
    "Which ocean is the largest?",
    "How many legs does a spider have?",
    "What is the capital of Japan?",
    "What is 7 plus 8?",
    "Who painted the Mona Lisa?",
    "What language is spoken in Brazil?",
    "What is the freezing point of water in degrees Fahrenheit?",
    "How many continents are there?",
    "What is the square root of 81?",
    "What color is the sky on a clear day?",
)
NEAR_TIE_NATS = 0.5


def question_prompts(tokenizer, questions=QUESTIONS, context_chars: int = CONTEXT_CHARS) -> list[list[int]]:
    """Chat prompts (token ids): the license text, a blank line, the question."""
    context = TEXT.read_text()[:context_chars]
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{context}\n\n{question}"}], add_generation_prompt=True
        )
        for question in questions
    ]


def shared_prefix_length(prompts: list[list[int]]) -> int:
    """How many leading tokens every prompt has in common (prefilled once, then copied)."""
    shortest = min(len(p) for p in prompts)
    return next((i for i in range(shortest) if len({p[i] for p in prompts}) > 1), shortest)


def prefill(model, tokens: list[int], cache: list) -> list:
    """`cache` after `tokens` went through the model: a prefix to copy for each prompt."""
    if tokens:
        model(mx.array(tokens)[None], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def greedy_answer(
    model, tokens: list[int], cache: list, max_tokens: int, eos_ids, **generate_kwargs
) -> tuple[list[int], list[mx.array]]:
    """Greedy continuation of `tokens` over a copy of `cache` (which may hold a prefix of the
    prompt already): the token ids, ending with the end-of-sequence token if one came, and each
    step's log-probabilities. `generate_kwargs` go to mlx-lm's generate_step (e.g. kv_bits)."""
    out, logprobs = [], []
    steps = generate_step(
        mx.array(tokens), model, prompt_cache=copy.deepcopy(cache), max_tokens=max_tokens, **generate_kwargs
    )
    for token, step_logprobs in steps:
        out.append(token)
        logprobs.append(step_logprobs)
        if token in eos_ids:
            break
    return out, logprobs


def departure(reference: list[int], reference_logprobs: list[mx.array], other: list[int]) -> dict | None:
    """Where `other` first leaves the `reference` answer and by how much the reference's own
    token led there (nats, from the reference's log-probabilities); None when they agree.
    An answer cut short by the token limit agrees as far as it goes."""
    at = next((i for i, (a, b) in enumerate(zip(reference, other, strict=False)) if a != b), None)
    if at is None:
        return None
    lead = reference_logprobs[at][reference[at]] - reference_logprobs[at][other[at]]
    return {"token": at, "fp16_margin_nats": round(lead.item(), 4)}


def lead_shifts(
    model, tokens: list[int], cache: list, reference: list[int], reference_logprobs: list[mx.array]
) -> list[tuple[float, float]]:
    """How far a cache moves fp16's decisions along fp16's own answer: at each answer token,
    (shift, lead) — lead: fp16's token over fp16's runner-up under fp16, in nats; shift: that
    same lead under `cache` (fed `tokens`, then the reference answer: teacher forcing) minus it.
    Their spread is the noise a near tie must outlast; a decision is overturned where
    lead + shift < 0."""
    if not reference:
        return []
    logits = model(mx.array(tokens + reference[:-1])[None], cache=copy.deepcopy(cache))
    logprobs = logits[0, -len(reference) :].astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    pairs = []
    for i, token in enumerate(reference):
        fp16 = reference_logprobs[i].astype(mx.float32)
        runner_up = mx.argmax(mx.where(mx.arange(fp16.shape[-1]) == token, -mx.inf, fp16)).item()
        lead = (fp16[token] - fp16[runner_up]).item()
        after = (logprobs[i, token] - logprobs[i, runner_up]).item()
        pairs.append((round(after - lead, 4), lead))
    return pairs


def is_near_tie(found: dict | None) -> bool:
    """The rule: the answers agree, or part where fp16 was nearly undecided."""
    return found is None or found["fp16_margin_nats"] < NEAR_TIE_NATS
