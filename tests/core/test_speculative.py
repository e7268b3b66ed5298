"""Speculative decoding in the engine's step: drafts verified in one forward keep greedy tokens
exactly, keep a sampling request's distribution, trim the rejected positions from every KV cache
kind, and hand out caches in token order."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import StopSequences
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import greedy_sampler, make_logits_processors

from services.core.batch_step import BatchStep
from services.core.kv import make_kv_cache
from services.core.sampling import FilteredSampler, logit_bias_processor
from services.core.sequence_batch import SequenceBatch
from services.core.speculative import (
    SpeculativeConfig,
    SpeculativeCounters,
    SpeculativeDecoder,
    speculative_config,
)
from services.core.speculative.acceptance import accept_sampled
from services.core.speculative.draft_model import load_draft_model
from services.core.speculative.ngram import NgramDrafter

pytestmark = pytest.mark.slow  # starts processes or computes for seconds

PROMPTS = [list(range(3, 40)) + list(range(3, 20)), [5, 6, 7, 8] * 6, list(range(50, 60))]
MAX_TOKENS = [40, 25, 33]


@pytest.fixture(scope="module")
def model(tiny_models):
    loaded, _ = mlx_lm.load(str(tiny_models.checkpoint("qwen3_moe", None)))
    return loaded


class OracleDrafter:
    """Drafts the reference continuation with every `wrong`-th position wrong, so rows accept
    different counts in one step."""

    def __init__(self, references: list[list[int]], wrong: int):
        self.references = references
        self.wrong = wrong

    def index(self):
        return self

    def propose(self, context: list[int], k: int) -> list[int]:
        for full in self.references:
            if context == full[: len(context)]:
                draft = full[len(context) : len(context) + k]
                at = len(context)
                return [t if (at + j) % self.wrong else (t + 1) % 64 for j, t in enumerate(draft)]
        return []


def generate(
    model,
    kind: str,
    decoder: SpeculativeDecoder | None,
    samplers=None,
    max_tokens=MAX_TOKENS,
    processors=None,
    shapes: set | None = None,
):
    """Each prompt's tokens and finished (cache, tokens), and the steps taken; `shapes` collects
    the shapes of the responses' logprobs."""
    sequences = SequenceBatch(model, max_sequences=8, prefill_chunk=2048)
    samplers = samplers or [greedy_sampler] * len(PROMPTS)
    processors = processors or [()] * len(PROMPTS)
    uids = [
        sequences.insert(
            [prompt], limit, make_kv_cache(model, kind), sampler=sampler, logits_processors=chain
        )
        for prompt, limit, sampler, chain in zip(PROMPTS, max_tokens, samplers, processors, strict=True)
    ]
    tokens = {uid: [] for uid in uids}
    finished, steps, moved = {}, 0, 0
    while len(finished) < len(uids):
        step = BatchStep(
            sequences,
            decode=None if decoder is None else decoder.decode,
            prefill_sink=None if decoder is None else decoder.prefill_sink,
        )
        _, responses = step.finish([task() for task in step.tasks])
        steps += 1
        if decoder is not None:
            moved = max(moved, len(decoder.order._slots))
        for response in responses:
            tokens[response.uid].append(response.token)
            if shapes is not None:
                shapes.add(tuple(response.logprobs.shape))
            if response.finish_reason:
                finished[response.uid] = (response.prompt_cache, response.all_tokens, response.finish_reason)
    return [tokens[u] for u in uids], [finished[u] for u in uids], steps, moved


@pytest.mark.parametrize("kind", ["fp16", "turboquant"])
@pytest.mark.parametrize("wrong", [2, 3, 7, 1000])
def test_greedy_tokens_equal_decoding_without_drafts(model, kind, wrong):
    reference, _, plain_steps, _ = generate(model, kind, None)
    full = [p + r for p, r in zip(PROMPTS, reference, strict=True)]
    counters = SpeculativeCounters()
    decoder = SpeculativeDecoder(
        SpeculativeConfig(num_speculative_tokens=4, draft_cost=0.0),
        counters,
        drafter=OracleDrafter(full, wrong),
    )
    tokens, finished, steps, moved = generate(model, kind, decoder)
    assert tokens == reference
    assert steps < plain_steps
    assert 0 < counters.accepted_tokens < counters.draft_tokens or wrong == 1000
    assert [len(t) for t in tokens] == MAX_TOKENS and all(f[2] == "length" for f in finished)
    if kind == "fp16" and wrong in (3, 7):
        assert moved > 0  # rows dropped different counts: their slots were moved


def test_rows_with_logits_processors_draft_and_keep_their_tokens(model):
    """Penalties and logit_bias see each kept token before the next position is processed, as
    one token per step would show it to them; rows without processors share the step."""

    def follows_context(tokens: mx.array, logits: mx.array) -> mx.array:
        """Picks a token from the whole context, so a context missing a kept token shows."""
        return logits.at[..., (int(tokens[-1].item()) * 7 + tokens.size) % 64].add(50.0)

    no_repeats = make_logits_processors(repetition_penalty=1.5, frequency_penalty=0.5)
    processors = [[*no_repeats, follows_context], [logit_bias_processor({7: 5.0, 9: -100.0}, 64)], []]
    reference, _, plain_steps, _ = generate(model, "fp16", None, processors=processors)
    full = [p + r for p, r in zip(PROMPTS, reference, strict=True)]
    counters = SpeculativeCounters()
    decoder = SpeculativeDecoder(SpeculativeConfig(draft_cost=0.0), counters, drafter=OracleDrafter(full, 3))
    tokens, _, steps, _ = generate(model, "fp16", decoder, processors=processors, shapes=(shapes := set()))
    assert tokens == reference
    assert 9 not in tokens[1] and steps < plain_steps and counters.accepted_tokens > 0
    assert shapes == {(model.args.vocab_size,)}  # every token's logprobs as GenerationBatch gives them


def test_finished_caches_hold_their_tokens_in_order(model):
    reference, _, _, _ = generate(model, "fp16", None)
    full = [p + r for p, r in zip(PROMPTS, reference, strict=True)]
    decoder = SpeculativeDecoder(
        SpeculativeConfig(draft_cost=0.0), SpeculativeCounters(), drafter=OracleDrafter(full, 3)
    )
    _, finished, _, moved = generate(model, "fp16", decoder)
    assert moved > 0
    for cache, tokens, _ in finished:
        fresh = make_prompt_cache(model)
        model(mx.array([tokens]), cache=fresh)
        for got, want in zip(cache, fresh, strict=True):
            assert got.offset == want.offset == len(tokens)
            keys = got.keys[..., : got.offset, :]
            assert mx.allclose(keys, want.keys[..., : want.offset, :], atol=1e-4).item()


def test_a_stop_token_inside_an_accepted_draft_ends_the_sequence_there(model):
    reference, _, _, _ = generate(model, "fp16", None)
    full = [p + r for p, r in zip(PROMPTS, reference, strict=True)]
    stop_at = 9  # the sequence's 10th token stops it, though the draft runs past it
    sequences = SequenceBatch(model, max_sequences=4, prefill_chunk=2048)
    stop = reference[0][stop_at]
    first = reference[0].index(stop)
    sequences.insert(
        [PROMPTS[0]],
        40,
        make_kv_cache(model, "fp16"),
        sampler=greedy_sampler,
        stop_sequences=StopSequences([[stop]]),
    )
    decoder = SpeculativeDecoder(
        SpeculativeConfig(draft_cost=0.0), SpeculativeCounters(), drafter=OracleDrafter(full, 1000)
    )
    tokens, reason = [], None
    while reason is None:
        step = BatchStep(sequences, decode=decoder.decode)
        _, responses = step.finish([task() for task in step.tasks])
        for response in responses:
            tokens.append(response.token)
            reason = response.finish_reason
            if reason:
                assert response.all_tokens == PROMPTS[0] + tokens
                assert response.prompt_cache[0].offset == len(PROMPTS[0]) + len(tokens)
    assert tokens == reference[0][: first + 1] and reason == "stop"


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    index = NgramDrafter(max_n=3, min_n=1).index()
    context = [1, 2, 3, 4, 5, 1, 2, 3]
    assert index.propose(context, 4) == [4, 5, 1, 2]
    context += [4, 5]
    assert index.propose(context, 3) == [1, 2, 3]
    assert index.propose(context, 0) == []
    assert NgramDrafter().index().propose([7, 8, 9], 3) == []  # nothing recurs


def test_prompt_lookup_goes_on_repeating_a_repeat_that_runs_into_the_end():
    drafter = NgramDrafter(max_n=3, min_n=1)
    assert drafter.index().propose([9, 7, 7, 7], 4) == [7, 7, 7, 7]  # a run of one token
    assert drafter.index().propose([1, 5, 6, 5, 6], 4) == [5, 6, 5, 6]  # a short phrase again
    assert drafter.index().propose([1, 5, 6, 2, 5, 6], 4) == [2, 5, 6, 2]


def _sampler(seed: int) -> FilteredSampler:
    return FilteredSampler(temperature=0.8, filters=[], seed=seed)


def test_rejection_sampling_keeps_the_target_distribution():
    """The first emitted token is distributed as the sampler's target whatever the draft; a rule
    that keeps every draft, or one that resamples from p including the draft, fails this test."""
    logits = mx.array([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5]] * 2)
    target = mx.softmax(logits[0] / 0.8).tolist()
    trials = 3000
    draft = [1]  # a plausible but not the likeliest token

    def first_tokens(rule) -> list[int]:
        sampler = _sampler(7)
        counts = [0] * len(target)
        for _ in range(trials):
            kept, token = rule(draft, logits, sampler)
            counts[draft[0] if kept else token] += 1
        return counts

    def chi_square(counts):
        return sum((c - trials * p) ** 2 / (trials * p) for c, p in zip(counts, target, strict=True))

    critical = 20.5  # chi-square, 5 degrees of freedom, p = 0.001
    assert chi_square(first_tokens(accept_sampled)) < critical

    def keep_every_draft(draft, logits, sampler):
        return len(draft), 0

    def residual_with_the_draft(draft, logits, sampler):
        kept, token = accept_sampled(draft, logits, sampler)
        if kept:
            return kept, token
        return 0, int(sampler.categorical(sampler.target_logprobs(logits[:1])[0]).item())

    assert chi_square(first_tokens(keep_every_draft)) > critical
    assert chi_square(first_tokens(residual_with_the_draft)) > critical


def test_seeded_sampling_with_drafts_repeats(model):
    reference, _, _, _ = generate(model, "fp16", None)
    full = [p + r for p, r in zip(PROMPTS, reference, strict=True)]

    def run():
        decoder = SpeculativeDecoder(
            SpeculativeConfig(draft_cost=0.0), SpeculativeCounters(), drafter=OracleDrafter(full, 3)
        )
        samplers = [_sampler(seed) for seed in (1, 2, 3)]
        return generate(model, "fp16", decoder, samplers=samplers)[0]

    first = run()
    assert first == run()
    assert [len(t) for t in first] == MAX_TOKENS


def test_flags_and_vllm_json_make_one_config():
    assert speculative_config(None, None, None) is None
    assert speculative_config("ngram", 3, None) == SpeculativeConfig("ngram", 3)
    vllm = '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}'
    assert speculative_config(None, None, vllm) == SpeculativeConfig("ngram", 5, prompt_lookup_max=3)
    assert speculative_config(None, 2, vllm).num_speculative_tokens == 2  # the flag wins
    for bad, words in [
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "eagle"}', "method"),
        ('{"method": "ngram", "draft_tensor_parallel_size": 1}', "unsupported keys"),
        ("[1]", "JSON object"),
        ("{", "not JSON"),
    ]:
        with pytest.raises(ValueError, match=words):
            speculative_config(None, None, bad)
    with pytest.raises(ValueError, match="needs a method"):
        speculative_config(None, 4, None)
    assert speculative_config(
        None, None, '{"method": "mtp", "num_speculative_tokens": 1}'
    ) == SpeculativeConfig(method="mtp", num_speculative_tokens=1)


def test_counters_count_drafts_and_acceptance_by_position():
    counters = SpeculativeCounters()
    counters.record(4, 2)
    counters.record(3, 0)
    counters.record(0, 0)
    assert (counters.drafts, counters.draft_tokens, counters.accepted_tokens) == (2, 7, 2)
    assert counters.accepted_per_position[:3] == [1, 1, 0]
    assert math.isclose(counters.accepted_tokens / counters.draft_tokens, 2 / 7)


@pytest.mark.parametrize("draft_arch", ["qwen3_moe", "mixtral"])
def test_a_draft_model_drafts_and_greedy_tokens_stay_exact(model, tiny_models, draft_arch):
    """The served model as its own draft accepts nearly every token; another model with the same
    tokenizer accepts few; either way the tokens are those of decoding without drafts."""
    reference, _, plain_steps, _ = generate(model, "fp16", None)
    _, tokenizer = mlx_lm.load(str(tiny_models.checkpoint("qwen3_moe", None)))
    drafter = load_draft_model(
        str(tiny_models.checkpoint(draft_arch, None)), tokenizer, model.args.vocab_size
    )
    counters = SpeculativeCounters()
    # priced as a hop-bound step: on this CPU the drafts (a model as large as the served one)
    # cost more than the steps they save, and the measured price would stop most of them
    decoder = SpeculativeDecoder(SpeculativeConfig("draft:x", 4, draft_cost=0.0), counters, drafter=drafter)
    tokens, _, steps, _ = generate(model, "fp16", decoder)
    assert tokens == reference
    assert counters.drafts > 0
    if draft_arch == "qwen3_moe":
        assert counters.accepted_tokens > 0.9 * counters.draft_tokens and steps < plain_steps / 2


def test_a_draft_model_with_another_tokenizer_is_refused(tiny_models):
    from services.tools.demo_model import ensure_demo_model

    _, tokenizer = mlx_lm.load(str(tiny_models.checkpoint("qwen3_moe", None)))
    with pytest.raises(ValueError, match="does not share the served model's tokenizer"):
        load_draft_model(str(ensure_demo_model(dense=True, progress=False)), tokenizer, 100)
    with pytest.raises(ValueError, match="could not be loaded"):
        load_draft_model("/nonexistent/draft", tokenizer, 100)


def test_vllm_draft_model_config():
    config = speculative_config(None, None, '{"model": "/m/draft", "num_speculative_tokens": 3}')
    assert config.method == "draft:/m/draft" and config.draft_model == "/m/draft"
    assert speculative_config("draft:/m/x", None, None).draft_model == "/m/x"
    with pytest.raises(ValueError, match="needs `model`"):
        speculative_config(None, None, '{"method": "draft_model"}')
    with pytest.raises(ValueError, match="method must be one of"):
        speculative_config("draft:", None, None)


@pytest.mark.parametrize("arch", ["deepseek_v3", "mixtral", "olmoe", "phimoe", "granitemoe", "phixtral"])
def test_every_family_with_trimmable_caches_keeps_greedy_tokens(tiny_models, arch):
    family, _ = mlx_lm.load(str(tiny_models.checkpoint(arch, None)))
    reference, _, plain_steps, _ = generate(family, "fp16", None)
    full = [p + r for p, r in zip(PROMPTS, reference, strict=True)]
    decoder = SpeculativeDecoder(
        SpeculativeConfig(draft_cost=0.0), SpeculativeCounters(), drafter=OracleDrafter(full, 3)
    )
    tokens, _, steps, moved = generate(family, "fp16", decoder)
    assert tokens == reference
    assert steps < plain_steps and moved > 0


def test_up_passes_speculation_to_core_and_refuses_a_bad_method_before_starting():
    import subprocess
    import sys

    from services.ops.cli import _serving_cli_args, build_parser

    vllm = '{"method": "ngram", "prompt_lookup_max": 3}'
    up = build_parser().parse_args(["up", "--speculative-config", vllm, "--num-speculative-tokens", "3"])
    core = build_parser().parse_args(["core", *_serving_cli_args(up)])
    config = speculative_config(core.speculative, core.num_speculative_tokens, core.speculative_config)
    assert config == SpeculativeConfig("ngram", 3, prompt_lookup_max=3)
    assert "--speculative" not in _serving_cli_args(build_parser().parse_args(["up"]))
    refused = subprocess.run(
        [sys.executable, "-m", "services.ops.cli", "up", "--speculative", "bogus"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 1 and "speculative method must be one of" in refused.stderr


@pytest.mark.parametrize("per_draft_s, drafts_pay", [(0.004, True), (0.2, False)])
def test_drafting_follows_what_a_drafted_token_costs(model, monkeypatch, per_draft_s, drafts_pay):
    """With the cost measured (no draft_cost given): a clock where each drafted token adds
    `per_draft_s` to a 0.1 s step. Cheap drafts keep drafting; drafts that cost two steps each stop
    after the first priced steps. Either way the tokens are those of decoding without drafts."""
    reference, _, plain_steps, _ = generate(model, "fp16", None)
    full = [p + r for p, r in zip(PROMPTS, reference, strict=True)]
    counters = SpeculativeCounters()
    decoder = SpeculativeDecoder(SpeculativeConfig(), counters, drafter=OracleDrafter(full, 1000))
    clock = {"now": 0.0}

    def perf_counter() -> float:
        step = decoder.costs._step  # the step this mark ends
        clock["now"] += 0.1 + (per_draft_s * step[1] if step else 0.0)
        return clock["now"]

    monkeypatch.setattr("services.core.speculative.decode.time.perf_counter", perf_counter)
    tokens, _, steps, _ = generate(model, "fp16", decoder)
    assert tokens == reference
    if drafts_pay:
        assert decoder.costs.per_draft < 0.1 and steps < plain_steps / 2
    else:
        assert decoder.costs.per_draft >= 1.0
        assert counters.drafts <= 3 * len(PROMPTS) and steps > 0.8 * plain_steps
