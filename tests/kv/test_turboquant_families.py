"""TurboQuant caches under every MoE family mlx-lm provides.

A request may ask for TurboQuant whatever the model, so every family's attention must run with
`make_kv_cache(model, "turboquant")`: layers whose attention TurboQuant's cannot stand in for (MLA's
latent caches, gpt-oss's attention sinks) keep mlx-lm's own cache and give exactly its logits.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from services.common.model_build import build_skeleton
from services.core.kv import TurboQuantKVCache, make_kv_cache
from services.core.kv.factory import turboquant_unsupported_layers
from services.tools.moe_families import mlx_lm_moe_families, tiny_config
from tests.e2e.test_every_family import REFUSED  # split refuses them: never served

PROMPT = mx.array([list(range(1000, 1009))])


def forward_twice(model, caches) -> mx.array:
    """Logits of a prompt's prefill and of one decoded token after it."""
    model(PROMPT[:, :-1], cache=caches)
    return model(PROMPT[:, -1:], cache=caches)


@pytest.mark.slow  # builds and runs some fifty models
@pytest.mark.parametrize("family", [f for f in mlx_lm_moe_families() if f not in REFUSED])
def test_every_family_runs_under_turboquant_caches(family):
    mx.random.seed(0)
    model = build_skeleton(tiny_config(family))
    mx.eval(model.parameters())
    caches = make_kv_cache(model, "turboquant")
    logits = forward_twice(model, caches)
    assert mx.all(mx.isfinite(logits)).item()
    plain = turboquant_unsupported_layers(model)
    for layer in plain:
        assert not isinstance(caches[layer], TurboQuantKVCache)
    if not any(isinstance(c, TurboQuantKVCache) for c in caches):  # TurboQuant applies nowhere
        assert mx.array_equal(logits, forward_twice(model, make_kv_cache(model, "fp16"))).item()


@pytest.mark.parametrize(
    ("family", "why"), [("deepseek_v3", "MLA"), ("kimi_vl", "MLA"), ("gpt_oss", "sinks")]
)
def test_layers_turboquant_cannot_serve_are_found(family, why):
    model = build_skeleton(tiny_config(family))
    assert turboquant_unsupported_layers(model) == frozenset(range(len(model.layers))), why
    assert not turboquant_unsupported_layers(build_skeleton(tiny_config("qwen3_moe")))
