"""Experts in core's own process (`--worker local`): the same numbers as mlx-lm on the original
checkpoint, whether a layer joins core's graph, computes on the host (CPU kernel, streamed
experts) or stays on a worker process beside local layers."""

from __future__ import annotations

import grpc
import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step

from services.common.manifest import Manifest
from services.core.expert_link.local import HostComputedExperts, LocalExperts
from services.core.expert_link.local_spec import LocalExpertsSpec
from services.core.model_loader import load_core_model
from services.experts.store_setup import shard_bytes
from services.proto.moemesh.v1 import core_pb2, core_pb2_grpc
from tests.helpers import core_args, linked_dispatcher, spawn, stop, wait_serving

pytestmark = pytest.mark.slow  # starts processes or computes for seconds

PROMPT = "The quick brown fox jumps over the lazy dog because"
STEPS = 24


def greedy(model, prompt: mx.array, steps: int = STEPS) -> list[int]:
    return [int(token) for token, _ in generate_step(prompt, model, max_tokens=steps)]


def assert_matches_mlx_lm(core, reference, prompt: mx.array) -> None:
    want = reference(prompt[None])[0, -1]
    got = core(prompt[None])[0, -1]
    relative = (mx.abs(got - want).max() / mx.abs(want).max()).item()
    assert relative < 1e-4, f"last-position logits differ by {relative:.2e} relative"
    assert greedy(core, prompt) == greedy(reference, prompt)


@pytest.mark.parametrize(
    ("bits", "budget", "in_graph"),
    [(None, None, True), (4, None, False), (None, 0.5, False)],
    ids=["float32-in-graph", "4bit-cpu-kernel", "float32-streamed"],
)
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_local_experts_match_mlx_lm(tiny_models, arch, bits, budget, in_graph):
    split = tiny_models.split(arch, bits)
    manifest = Manifest.load(split)
    memory_gb = (
        None if budget is None else budget * shard_bytes(manifest, LocalExpertsSpec().owned(manifest)) / 1e9
    )
    local = LocalExperts(split, manifest, LocalExpertsSpec("all", memory_gb))
    try:
        modules = local.modules()
        # where MLX runs on the CPU, quantized layers compute with the CPU kernel on the host
        assert all(isinstance(m, HostComputedExperts) != in_graph for m in modules.values())
        core, _ = load_core_model(split, manifest, None, local_modules=modules)
        reference, tokenizer = mlx_lm.load(str(tiny_models.checkpoint(arch, bits)))
        assert_matches_mlx_lm(core, reference, mx.array(tokenizer.encode(PROMPT)))
        if budget is not None:
            assert local.store.stats().misses > 0  # the budget held part of the shard: it streamed
    finally:
        local.close()


def test_local_layers_beside_a_worker_process(tiny_models, short_tmp):
    """Layer 0 in core, the others on a worker process: one model, two data paths."""
    split = tiny_models.split("qwen3_moe", None)
    manifest = Manifest.load(split)
    first = manifest.layers[0].layer
    local = LocalExperts(split, manifest, LocalExpertsSpec(str(first)))
    remote = {layer.layer for layer in manifest.layers} - {first}
    try:
        with linked_dispatcher(split, short_tmp, ["all"], layers=remote) as (_, dispatcher, _):
            core, _ = load_core_model(split, manifest, dispatcher, local_modules=local.modules())
            reference, tokenizer = mlx_lm.load(str(tiny_models.checkpoint("qwen3_moe", None)))
            assert_matches_mlx_lm(core, reference, mx.array(tokenizer.encode(PROMPT)))
            calls = len(dispatcher.timings)
            assert calls >= len(remote) * STEPS  # the remote layers went out
    finally:
        local.close()


def test_core_process_with_local_experts_generates_mlx_lm_tokens(tiny_models, short_tmp):
    """`moe-mesh core --worker local` as a real process, read over gRPC: no worker anywhere."""
    arch = "qwen3_moe"
    split = tiny_models.split(arch, None)
    reference, tokenizer = mlx_lm.load(str(tiny_models.checkpoint(arch, None)))
    prompt = tokenizer.encode(PROMPT)
    address = f"unix:{short_tmp / 'core.sock'}"
    log_path = short_tmp / "core.log"
    core = spawn(core_args(split, address, ["local"]), log_path)
    try:
        wait_serving(address, core, log_path=log_path)
        with grpc.insecure_channel(address) as channel:
            request = core_pb2.GenerateRequest(
                token_ids=core_pb2.TokenIds(ids=prompt),
                sampling=core_pb2.SamplingParams(temperature=0),
                stopping=core_pb2.StoppingCriteria(max_tokens=STEPS, ignore_eos=True),
            )
            tokens = [
                t
                for chunk in core_pb2_grpc.CoreStub(channel).Generate(request, timeout=120)
                for t in chunk.token_ids
            ]
        assert tokens == greedy(reference, mx.array(prompt))
    finally:
        stop([core])


def near_tie_or_equal(reference, prompt: list[int], want: list[int], got: list[int]) -> None:
    """Greedy tokens equal, or where they first differ mlx-lm's own logits (the prefix teacher-
    forced) put the two tokens within bf16 rounding of each other: two ulps of the logit."""
    step = next((i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b), None)
    if step is None:
        return
    logits = reference(mx.array(prompt + want[:step])[None])[0, -1].astype(mx.float32)
    gap = abs((logits[want[step]] - logits[got[step]]).item())
    ulp = 2.0 ** (int(mx.floor(mx.log2(mx.abs(logits).max())).item()) - 7)  # bf16: 8 significant bits
    assert gap <= 2 * ulp, f"step {step}: {want[step]} vs {got[step]}, a logit gap of {gap} (ulp {ulp})"


@pytest.mark.parametrize("where", ["local-in-graph", "worker-process"])
def test_bfloat16_split_keeps_mlx_lm_greedy_tokens(tiny_models, short_tmp, where):
    """bf16 weights, 4-bit experts: the split's greedy tokens are mlx-lm's, or leave them only at
    a near tie that bf16 rounding can flip."""
    split = tiny_models.split("qwen3_moe", 4, "bf16-f32-norms")
    manifest = Manifest.load(split)
    reference, tokenizer = mlx_lm.load(str(tiny_models.checkpoint("qwen3_moe", 4, "bf16-f32-norms")))
    prompt = tokenizer.encode(PROMPT)
    want = greedy(reference, mx.array(prompt))
    if where == "local-in-graph":
        local = LocalExperts(split, manifest, LocalExpertsSpec(), kernel="mlx")
        core, _ = load_core_model(split, manifest, None, local_modules=local.modules())
        near_tie_or_equal(reference, prompt, want, greedy(core, mx.array(prompt)))
        local.close()
        return
    with linked_dispatcher(split, short_tmp, ["all"]) as (_, dispatcher, _):
        core, _ = load_core_model(split, manifest, dispatcher)
        near_tie_or_equal(reference, prompt, want, greedy(core, mx.array(prompt)))


def test_the_near_tie_rule_catches_a_wrong_token(tiny_models):
    reference, tokenizer = mlx_lm.load(str(tiny_models.checkpoint("qwen3_moe", 4, "bf16-f32-norms")))
    prompt = tokenizer.encode(PROMPT)
    want = greedy(reference, mx.array(prompt), 4)
    logits = reference(mx.array(prompt + want[:2])[None])[0, -1]
    worst = int(mx.argmin(logits).item())  # the least likely token: no tie with the greedy one
    with pytest.raises(AssertionError, match="step 2"):
        near_tie_or_equal(reference, prompt, want, [*want[:2], worst, *want[3:]])
