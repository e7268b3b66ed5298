"""Speculative decoding on hybrid models (Qwen3.5, Qwen3-Next): their linear-attention layers keep
only the accepted positions, so greedy tokens and the state a finished sequence leaves behind equal
those of decoding without drafts; caches nothing can replay are refused by name."""

from __future__ import annotations

import asyncio
import json

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from mlx_lm.models.cache import make_prompt_cache

from services.core.speculative import SpeculativeConfig, SpeculativeCounters, SpeculativeDecoder
from services.core.speculative.recurrent_rows import ReplayableMixer, recurrent_rows
from tests.core.test_speculative import PROMPTS, OracleDrafter, generate

pytestmark = pytest.mark.slow  # builds a model and decodes for seconds


class Counted(nn.Module):
    def __init__(self, linear: nn.Module, calls: list):
        super().__init__()
        self.linear = linear
        self._calls = calls

    def __call__(self, x: mx.array) -> mx.array:
        self._calls.append(x.shape)
        return self.linear(x)


@pytest.fixture(scope="module")
def hybrid(tiny_models):
    model, _ = mlx_lm.load(str(tiny_models.checkpoint("qwen3_5_moe", None)))
    return model


def test_a_replayed_layer_holds_what_feeding_only_the_kept_positions_leaves(hybrid):
    rows = recurrent_rows(hybrid)
    assert rows is not None and set(rows.mixers) == {0, 2}  # the model's linear-attention layers
    prompt = mx.array([[5, 17, 33, 2, 9, 41, 7, 3], [8, 8, 1, 30, 12, 6, 44, 2]])
    verified = mx.array([[20, 11, 12, 13, 14], [21, 15, 16, 17, 18]])
    keep = [2, 4]  # row 0 kept its pending token and one draft, row 1 three drafts
    drop = [verified.shape[1] - k for k in keep]

    def prefilled():
        cache = make_prompt_cache(hybrid)
        hybrid(prompt, cache=cache)
        return cache

    cache = prefilled()
    projected = []  # each input projection the linear-attention layers compute
    own = {}
    for index, mixer in rows.mixers.items():
        for name, linear in mixer.mixer.children().items():
            if name.startswith("in_proj"):  # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
                own[index, name] = linear
                setattr(mixer.mixer, name, Counted(linear, projected))
    rows.arm(cache)
    hybrid(verified, cache=cache)
    assert len(projected) == len(own)
    rows.settle(cache, drop)
    assert len(projected) == len(own)  # the replay reuses the verify forward's projections
    for (index, name), linear in own.items():
        setattr(rows.mixers[index].mixer, name, linear)
    for row, kept in enumerate(keep):
        fed = make_prompt_cache(hybrid)
        hybrid(prompt[row : row + 1], cache=fed)
        hybrid(verified[row : row + 1, :kept], cache=fed)
        for index in rows.mixers:
            for part in (0, 1):  # the convolution window and the recurrent state
                assert mx.allclose(cache[index][part][row], fed[index][part][0], atol=1e-5)


@pytest.mark.parametrize("kind", ["fp16", "turboquant"])
def test_greedy_tokens_and_final_states_equal_decoding_without_drafts(hybrid, kind):
    reference, finished, plain_steps, _ = generate(hybrid, kind, None)
    full = [p + r for p, r in zip(PROMPTS, reference, strict=True)]
    decoder = SpeculativeDecoder(
        SpeculativeConfig(draft_cost=0.0),
        SpeculativeCounters(),
        drafter=OracleDrafter(full, 3),
        recurrent=recurrent_rows(hybrid),
    )
    tokens, drafted, steps, _ = generate(hybrid, kind, decoder)
    assert tokens == reference
    assert steps < plain_steps and decoder.counters.accepted_tokens > 0
    for (plain_cache, _, _), (cache, _, _) in zip(finished, drafted, strict=True):
        for index in decoder.recurrent.mixers:  # what the prefix cache would keep for reuse
            for part in (0, 1):
                assert mx.allclose(cache[index][part], plain_cache[index][part], atol=1e-4)


@pytest.mark.parametrize(
    "arch, cache", [("gpt_oss", "RotatingKVCache"), ("nemotron_h_latent", "ArraysCache")]
)
def test_caches_nothing_replays_are_refused_by_name(tiny_models, arch, cache):
    model, _ = mlx_lm.load(str(tiny_models.checkpoint(arch, None)))
    with pytest.raises(ValueError, match=f"keeps {cache} in layer"):
        recurrent_rows(model)


def test_making_a_model_replayable_twice_wraps_each_layer_once(hybrid):
    first, second = recurrent_rows(hybrid), recurrent_rows(hybrid)
    assert first.mixers.keys() == second.mixers.keys()
    for index, mixer in second.mixers.items():
        assert mixer is first.mixers[index] and not isinstance(mixer.mixer, ReplayableMixer)


async def test_a_hybrid_core_drafts_with_the_tokens_of_one_without(tiny_models):
    """Real core processes and workers on a split Qwen3.5-MoE: a core drafting with a small model
    (a random Qwen3-MoE on the same tokenizer, so nearly every draft is rejected and every step
    replays the recurrent layers) answers concurrent requests with the greedy tokens of a core
    without drafts."""
    import grpc

    from services.proto.moemesh.v1 import core_pb2, core_pb2_grpc
    from tests.core.test_batching import running
    from tests.core.test_speculative_service import token_request

    draft = {"method": f"draft:{tiny_models.checkpoint('qwen3_moe', None)}", "num_speculative_tokens": 3}
    configs = {
        "off": ["--prefix-cache-gb", "0"],
        # draft whatever a step costs here
        "draft": ["--prefix-cache-gb", "0", "--speculative-config", json.dumps({**draft, "draft_cost": 0})],
    }
    prompts = [[5, 6, 7, 8] * 6, list(range(3, 40)) + list(range(3, 20))]
    answers = {}
    with running(tiny_models.split("qwen3_5_moe", None), configs) as cores:
        for name, core in cores.items():
            async with grpc.aio.insecure_channel(core.address) as channel:
                stub = core_pb2_grpc.CoreStub(channel)

                async def tokens(request, stub=stub):
                    return [t async for c in stub.Generate(request, timeout=600) for t in c.token_ids]

                answers[name] = await asyncio.gather(*(tokens(token_request(p, 30)) for p in prompts))
                stats = await stub.GetStats(core_pb2.GetStatsRequest())
            if name == "draft":
                assert stats.speculative.drafts > 0
            assert stats.running_requests == 0 and stats.kv_cache_bytes == 0
    assert answers["draft"] == answers["off"]
