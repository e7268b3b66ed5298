"""Models whose first layers are dense (DeepSeek-V3's `first_k_dense_replace`, and the Kimi-K2 and
GLM-4.5 families built on it): a worker told to serve "all" layers, as `up` and cluster.toml tell
it, serves every MoE layer; naming a dense layer is still refused."""

from __future__ import annotations

import pytest

from services.common.manifest import Manifest
from services.experts.server import owned_experts
from tests.helpers import Workers, short_dir


def test_all_layers_means_every_moe_layer(tiny_models):
    manifest = Manifest.load(tiny_models.split("deepseek_v3", None))
    assert 0 not in manifest.layer_indices  # its first layer is dense
    for layers in (None, "", "all"):
        owned = owned_experts(manifest, layers, "0-2")
        assert sorted(owned) == sorted(manifest.layer_indices) and owned[1] == [0, 1, 2]
    with pytest.raises(ValueError, match="0 are not MoE layers"):
        owned_experts(manifest, "0-1", None)


@pytest.mark.slow
def test_a_worker_over_all_layers_of_a_dense_first_model_serves(tiny_models):
    split = tiny_models.split("deepseek_v3", None)
    workers = Workers(split, short_dir(), ["0-3", "4-7"], extra_args=("--layers", "all")).start()
    workers.stop()
