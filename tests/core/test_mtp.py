"""`--speculative mtp`: split keeps a checkpoint's multi-token-prediction layer for core, the layer
drafts from the hidden states of the main model's verify forwards, and greedy tokens stay those of
decoding without it, in the engine and through a real core process."""

from __future__ import annotations

import asyncio
import copy
import json

import grpc
import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, make_prompt_cache, trim_prompt_cache

from services.core.speculative import SpeculativeConfig, SpeculativeCounters, SpeculativeDecoder
from services.core.speculative.mtp import MtpDrafter, load_mtp, text_model
from services.core.speculative.mtp_prefix import split_prefix_state
from services.core.speculative.mtp_weights import MTP_FILE, unsupported_reason
from services.proto.moemesh.v1 import core_pb2, core_pb2_grpc
from tests.core.test_batching import GREEDY, run, running
from tests.core.test_speculative import PROMPTS, generate
from tests.core.vision_serving import Served

ARCH = "deepseek_v3_mtp"


@pytest.fixture(scope="module")
def split(tiny_models):
    return tiny_models.split(ARCH, None)


@pytest.fixture(scope="module")
def mtp_model(tiny_models, split):
    return load_with_mtp(tiny_models, ARCH, split)


def load_with_mtp(tiny_models, arch: str, split):
    """The tiny checkpoint's model, as mlx-lm loads it, and its MTP layer from the split."""
    model, _ = mlx_lm.load(str(tiny_models.checkpoint(arch, None)))
    config = json.loads((split / "core" / "config.json").read_text())
    return model, load_mtp(model, split, config)


def test_split_keeps_the_mtp_layer_for_core_with_its_experts_stacked(split):
    weights = mx.load(str(split / "core" / MTP_FILE))
    names = set(weights)
    assert {
        "mtp.0.enorm.weight",
        "mtp.0.hnorm.weight",
        "mtp.0.eh_proj.weight",
        "mtp.0.shared_head.norm.weight",
    } <= names
    assert weights["mtp.0.mlp.switch_mlp.gate_proj.weight"].shape[0] == 8  # 8 experts, one tensor
    assert not any(".experts." in n or "embed_tokens" in n or "shared_head.head" in n for n in names)
    manifest = json.loads((split / "manifest.json").read_text())
    assert [layer["layer"] for layer in manifest["layers"]] == [1, 2, 3]  # workers get no MTP layer


def reference_drafts(model, layer, context: list[int], k: int) -> list[int]:
    """The drafts after `context`, from scratch: the main model's normed hidden states over the
    whole context, each with the token that follows it, through the MTP layer without a cache of
    earlier steps; then k-1 chained steps."""
    inner = model.model
    hidden = inner(mx.array([context]))  # [1, L, H], after the final norm
    embedded = inner.embed_tokens(mx.array([context[1:]]))
    cache = KVCache()
    x = layer.eh_proj(mx.concatenate([layer.enorm(embedded), layer.hnorm(hidden[:, :-1])], axis=-1))
    out = layer.shared_head["norm"](layer.block(x, create_attention_mask(x, cache, return_array=True), cache))
    drafts = []
    for _ in range(k):
        token = mx.argmax(text_model(model).lm_head.head(out[:, -1:])[0, -1])
        drafts.append(int(token.item()))
        out = layer(inner.embed_tokens(token.reshape(1, 1)), out[:, -1:], cache)
    return drafts


def test_mtp_drafts_equal_the_layer_run_from_scratch_across_rejections(mtp_model):
    """A sequence fed in pieces (a prefill chunk, then verify forwards of different lengths, with
    drafted positions cut off, and a step that drafts nothing) drafts what the layer computes over
    the whole context at once."""
    model, layer = mtp_model
    drafter = MtpDrafter(model, layer, None)
    sequence = drafter.index()
    context = [5, 9, 17, 33, 2, 71, 8]
    fed = len(context) - 1  # the prompt but its last token, as a prefill chunk
    model(mx.array([context[:fed]]))
    sequence.feed(drafter.last_hidden(), context[:fed])
    for extra, drafting in (([40, 41, 42], True), ([7], False), ([90, 91], True), ([3], True)):
        if drafting:
            drafts = sequence.propose(context, 3)
            mx.eval(drafts)
            assert drafts.tolist() == reference_drafts(model, layer, context, 3)
        context = context + extra
        model(mx.array([context[:-1]]))  # a verify forward: the pending token and kept drafts
        sequence.feed(drafter.last_hidden()[:, fed:], context[fed:-1])
        fed = len(context) - 1


@pytest.mark.slow  # decodes for seconds
def test_greedy_tokens_equal_decoding_without_mtp(mtp_model):
    kind = "fp16"  # MLA keeps a latent cache, which TurboQuant does not compress
    model, layer = mtp_model
    reference, _, plain_steps, _ = generate(model, kind, None)
    counters = SpeculativeCounters()
    decoder = SpeculativeDecoder(
        SpeculativeConfig(method="mtp", num_speculative_tokens=2, draft_cost=0.0),
        counters,
        drafter=MtpDrafter(model, layer, None),
    )
    fed = []
    sink = decoder.prefill_sink
    decoder.prefill_sink = lambda uids, chunks: (
        fed.extend(t for chunk in chunks for t in chunk),
        sink(uids, chunks),
    )
    tokens, _, steps, _ = generate(model, kind, decoder)
    assert tokens == reference
    assert sorted(fed) == sorted(t for prompt in PROMPTS for t in prompt)  # every prompt token, once
    assert not decoder._prefilling  # each sequence's MTP state moved on when it began to decode
    model(mx.array([[5, 6, 7]]))
    decoder.prefilled([99], [[5, 6, 7]])
    assert 99 in decoder._prefilling
    decoder.forget(99)  # what the engine calls when a sequence leaves its batch, decoded or not
    assert not decoder._prefilling and 99 not in decoder._rows
    assert counters.drafts >= len(PROMPTS) and counters.draft_tokens > len(PROMPTS)
    assert steps <= plain_steps


@pytest.mark.slow  # decodes for seconds
def test_requests_that_never_draft_leave_the_mtp_layer_idle(mtp_model):
    """On a core drafting with MTP, a request sent with `speculative: false` decodes as without it
    and costs no MTP forward: neither its prompt nor its steps feed the layer."""
    model, layer = mtp_model
    drafter = MtpDrafter(model, layer, None)
    calls = []
    drafter.layer = lambda *args: (calls.append(args[0].shape), layer(*args))[1]
    decoder = SpeculativeDecoder(
        SpeculativeConfig(method="mtp", num_speculative_tokens=2, draft_cost=0.0),
        SpeculativeCounters(),
        wants=lambda uid: False,
        drafter=drafter,
    )
    tokens, _, _, _ = generate(model, "fp16", decoder)
    assert tokens == generate(model, "fp16", None)[0]
    assert calls == [] and decoder.counters.draft_tokens == 0


def test_models_without_servable_mtp_layers_are_refused_by_name():
    assert "num_nextn_predict_layers is 0" in unsupported_reason({"model_type": "deepseek_v3"})
    assert "(mtp_num_hidden_layers is 0)" in unsupported_reason({"model_type": "qwen3_next"})
    assert unsupported_reason({"model_type": "qwen3_next", "mtp_num_hidden_layers": 1}) is None
    dedicated = {"model_type": "qwen3_next", "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": True}
    assert "embeddings of their own" in unsupported_reason(dedicated)
    assert "qwen3_moe has no multi-token-prediction" in unsupported_reason({"model_type": "qwen3_moe"})
    assert unsupported_reason({"model_type": "glm4_moe", "num_nextn_predict_layers": 1}) is None
    qwen35 = {"model_type": "qwen3_5_moe", "text_config": {"model_type": "qwen3_5_moe_text"}}
    assert "(mtp_num_hidden_layers is 0)" in unsupported_reason(qwen35)
    qwen35["text_config"]["mtp_num_hidden_layers"] = 1
    assert unsupported_reason(qwen35) is None
    wrapped = {
        "model_type": "kimi_k25",
        "text_config": {"model_type": "deepseek_v3", "num_nextn_predict_layers": 1},
    }
    assert "wraps its language model" in unsupported_reason(wrapped)


@pytest.mark.slow
async def test_a_core_drafting_with_mtp_gives_the_tokens_of_one_without(split, tiny_models):
    configs = {
        "off": ["--prefix-cache-gb", "0"],
        "mtp": ["--prefix-cache-gb", "0", "--speculative", "mtp", "--num-speculative-tokens", "2"]
        + ["--speculative-config", '{"draft_cost": 0}'],
    }
    stopping = core_pb2.StoppingCriteria(max_tokens=24, ignore_eos=True)
    requests = [
        core_pb2.GenerateRequest(prompt=p, sampling=GREEDY, stopping=stopping)
        for p in ("Hello there", "1 2 3 4")
    ]
    with running(split, configs) as cores:
        answers = {}
        for name, core in cores.items():
            async with grpc.aio.insecure_channel(core.address) as channel:
                stub = core_pb2_grpc.CoreStub(channel)
                answers[name] = await asyncio.gather(*(run(stub, r) for r in requests))
                answers[name + "_stats"] = await stub.GetStats(core_pb2.GetStatsRequest())
    assert [tokens for tokens, _ in answers["mtp"]] == [tokens for tokens, _ in answers["off"]]
    assert all(len(tokens) == 24 for tokens, _ in answers["mtp"])
    assert answers["mtp_stats"].speculative.draft_tokens > 0


@pytest.mark.parametrize("reuse", ["whole", "trimmed"])
def test_a_prefix_kept_with_its_mtp_state_drafts_as_if_fed_from_the_start(mtp_model, reuse):
    """The MTP state rides at the end of a prefix-cache entry and trims with it. A later prompt that
    reuses the whole entry, or a trimmed part (which gives up one cached position to recompute the
    hidden state the entry no longer holds), drafts what the layer computes over its whole context."""
    model, layer = mtp_model
    drafter = MtpDrafter(model, layer, None)
    first = [5, 9, 17, 33, 2, 71, 8, 40]
    sequence = drafter.index()
    main = make_prompt_cache(model)
    model(mx.array([first]), cache=main)
    sequence.feed(drafter.last_hidden(), first)
    entry = copy.deepcopy([*main, sequence.kept(len(first))])  # what the prefix cache holds
    shared = len(first) if reuse == "whole" else 5
    trim_prompt_cache(entry, len(first) - shared)  # what a lookup of a prompt sharing 5 tokens does

    cache, cached, kept = split_prefix_state(entry, shared, resumes=True)
    assert kept is not None and kept.slots == shared - 1
    assert cached == (shared if reuse == "whole" else shared - 1)  # no dangling state: one more to compute
    assert all(c.offset == cached for c in cache)
    context = first[:shared] + [77, 78, 79]
    resumed = drafter.resume(kept)
    model(mx.array([context[:-1]]))  # the forward over the positions the prefix cache did not hold
    resumed.feed(drafter.last_hidden()[:, cached:], context[cached:-1])
    drafts = resumed.propose(context, 3)
    mx.eval(drafts)
    assert drafts.tolist() == reference_drafts(model, layer, context, 3)


def test_mtp_state_is_kept_only_where_the_layer_saw_the_prefix_from_its_start(mtp_model):
    model, layer = mtp_model
    drafter = MtpDrafter(model, layer, None)
    late = drafter.index(origin=4)  # began past a prefix-cache hit that kept no MTP state
    model(mx.array([[5, 9, 17, 33, 2, 71]]))
    late.feed(drafter.last_hidden()[:, 4:], [2, 71])
    assert late.kept(6) is None
    main = make_prompt_cache(model)
    model(mx.array([[5, 9, 17]]), cache=main)
    whole = drafter.index()
    whole.feed(drafter.last_hidden(), [5, 9, 17])
    entry = [*main, whole.kept(3)]
    cache, cached, kept = split_prefix_state(entry, 3, resumes=False)  # a request that does not speculate
    assert kept is None and cached == 3 and len(cache) == len(main)


@pytest.mark.slow
def test_an_engine_resumes_mtp_drafting_from_the_prefix_cache(split, monkeypatch):
    """Through core's engine: a finished sequence's entry keeps its MTP state, the next prompts that
    share it resume from it (the whole entry, then a trimmed part), and greedy tokens equal those of
    an engine that does not speculate."""
    resumed = []  # (slots, whether the hidden state of the entry's last position came too)
    resume = MtpDrafter.resume

    def spy(self, kept):
        resumed.append((kept.slots, kept.dangling is not None))
        return resume(self, kept)

    monkeypatch.setattr(MtpDrafter, "resume", spy)
    mtp = SpeculativeConfig(method="mtp", num_speculative_tokens=2, draft_cost=0.0)
    engines = {"off": Served(split), "mtp": Served(split, speculative=mtp)}
    prompt = [5, 9, 17, 33, 2, 71, 8, 40, 11, 12]
    tokens, cached = {}, {}
    try:
        for name, served in engines.items():
            ((first, _),) = served.generate(token_request(prompt, 12))
            ((again, whole),) = served.generate(token_request(prompt + first + [7], 8))
            ((other, part),) = served.generate(token_request(prompt[:6] + [3, 4], 8))
            tokens[name], cached[name] = (first, again, other), (whole, part)
    finally:
        for served in engines.values():
            served.stop()
    assert tokens["mtp"] == tokens["off"]
    entry = len(prompt) + len(tokens["off"][0])  # the first sequence's positions, the whole of it
    assert cached["off"] == (entry, 6)
    # Each resumed state holds a slot per cached position but the last, whose hidden state came
    # with it; without that hidden state the cache gave up one position, computed again.
    assert [slots + dangling for slots, dangling in resumed] == list(cached["mtp"])
    assert cached["mtp"][0] >= entry - 1 and resumed[1] == (5, False)  # the shorter reuse was trimmed


def token_request(ids: list[int], max_tokens: int) -> core_pb2.GenerateRequest:
    return core_pb2.GenerateRequest(
        token_ids=core_pb2.TokenIds(ids=ids),
        sampling=GREEDY,
        stopping=core_pb2.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
    )
