"""Calls that ask only some (token, expert) pairs (-1 elsewhere), as core sends when a layer's
experts are spread over workers: the worker returns exactly mlx-lm's rows for the asked pairs."""

from __future__ import annotations

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

from services.common import tensor_codec
from services.common.manifest import Manifest
from services.common.model_build import expert_modules
from services.experts.compute import ExpertCompute
from services.experts.store import ResidentExpertStore
from services.proto.moemesh.v1 import expert_pb2

LAYER = 1

CASES = {
    # every token asks two pairs: the worker keeps them as each token's experts
    "same count per token": [[0, -1, 3, -1], [-1, 5, -1, 1], [7, 2, -1, -1]],
    "decode step, one token": [[-1, 4, -1, 6]],
    # uneven: one row per pair
    "different counts per token": [[0, 1, 3, -1], [-1, -1, -1, 1], [7, -1, -1, -1]],
    "a token asks nothing": [[0, 1, -1, -1], [-1, -1, -1, -1], [2, 3, -1, -1]],
    "every pair asked": [[0, 1, 3, 7], [6, 5, 4, 2]],
}


def layer_call(hidden: mx.array, ids: np.ndarray) -> expert_pb2.ExpertCall:
    return expert_pb2.ExpertCall(
        call_id=1,
        layer=LAYER,
        hidden=tensor_codec.encode(hidden),
        expert_ids=tensor_codec.encode(mx.array(ids)),
    )


@pytest.fixture(scope="module")
def setup(tiny_models):
    split = tiny_models.split("qwen3_moe", None)
    manifest = Manifest.load(split)
    owned = {layer.layer: list(range(layer.num_experts)) for layer in manifest.layers}
    compute = ExpertCompute(ResidentExpertStore(split, manifest, owned))
    model, _ = mlx_lm.load(str(tiny_models.checkpoint("qwen3_moe", None)))
    switch = dict(expert_modules(model))[f"model.layers.{LAYER}.mlp.switch_mlp"]
    return compute, switch, manifest.hidden_size


@pytest.mark.parametrize("name", list(CASES))
def test_asked_pairs_equal_mlx_lm_rows_in_order(setup, name):
    compute, switch, hidden_size = setup
    ids = np.array(CASES[name], dtype=np.int32)
    hidden = mx.random.normal((ids.shape[0], hidden_size), key=mx.random.key(len(name)))
    call = layer_call(hidden, ids)
    result = compute.run(call)
    asked = ids >= 0
    got = np.array(tensor_codec.decode(result.output, "output", 1 << 30))
    # mlx-lm's module on every pair (unasked ones pointed at expert 0), then the asked rows in
    # row-major order, which is the order the reply promises.
    want = np.array(switch(hidden, mx.array(np.where(asked, ids, 0))))[asked]
    assert got.shape == (int(asked.sum()), hidden_size)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert result.stats.pairs == int(asked.sum())


def test_a_call_whose_reply_would_pass_the_cap_is_rejected_before_computing(setup):
    """A reply holds a row per asked pair, k times the input: a call under the cap whose reply is
    over it is refused in-band (over gRPC it would otherwise end the whole stream)."""
    from services.experts.compute import CallRejected

    compute, _, hidden_size = setup
    ids = np.array([[0, 1, 2, 3]] * 8, dtype=np.int32)
    hidden = mx.zeros((8, hidden_size))
    call = layer_call(hidden, ids)
    capped = ExpertCompute.__new__(ExpertCompute)
    capped.__dict__.update(compute.__dict__, max_call_bytes=2 * hidden.nbytes)  # input fits, reply (4x) not
    with pytest.raises(CallRejected, match="reply"):
        capped.run(call)
    assert compute.run(call).stats.pairs == 32


@pytest.mark.parametrize("ids", [[[0, 8]], [[-2, 1]]], ids=["past the last expert", "below -1"])
def test_a_worker_holding_every_expert_still_refuses_ids_out_of_range(setup, ids):
    from services.experts.compute import CallRejected

    compute, _, hidden_size = setup
    with pytest.raises(CallRejected, match=r"expert ids must lie in \[-1, 8\)"):
        compute.run(layer_call(mx.zeros((1, hidden_size)), np.array(ids, dtype=np.int32)))


def test_a_worker_holding_some_experts_names_the_asked_ones_it_lacks(tiny_models, setup):
    from services.experts.compute import CallRejected

    _, switch, hidden_size = setup
    split = tiny_models.split("qwen3_moe", None)
    manifest = Manifest.load(split)
    compute = ExpertCompute(ResidentExpertStore(split, manifest, {LAYER: [0, 1, 2, 3]}))
    hidden = mx.random.normal((2, hidden_size), key=mx.random.key(3))
    with pytest.raises(CallRejected, match=r"experts \[5, 6\] of layer 1 are not served"):
        compute.run(layer_call(hidden, np.array([[0, 5], [6, -1]], dtype=np.int32)))
    ids = np.array([[0, -1], [3, 2]], dtype=np.int32)  # -1 is not asked: no expert to lack
    got = np.array(tensor_codec.decode(compute.run(layer_call(hidden, ids)).output, "output", 1 << 30))
    want = np.array(switch(hidden, mx.array(np.where(ids >= 0, ids, 0))))[ids >= 0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
