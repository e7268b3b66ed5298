"""The hook that lets mlx-lm's unchanged attention code use TurboQuant caches: mlx-lm's
`scaled_dot_product_attention`, wrapped in every module a model's layers come from, sends
a TurboQuant cache (one sequence or a batch of rows) to attention.py and every other
cache to the original.
"""

from __future__ import annotations

import sys

import mlx.core as mx
from mlx_lm.models import base as mlx_base

from services.core.kv.attention import turboquant_attention
from services.core.kv.batch_cache import BatchTurboQuantKVCache
from services.core.kv.cache import TurboQuantKVCache
from services.core.kv.unfused_prefill import unfused_attention, unfused_wanted

_HOOK_MARK = "_moe_mesh_turboquant"


def turboquant_cache_attention(cache, queries: mx.array, scale: float) -> mx.array | None:
    """Attention over `cache` when it is a TurboQuant one (a sequence or a batch of rows), with
    the queries at the cache's end; None for any other cache."""
    if isinstance(cache, TurboQuantKVCache):
        return turboquant_attention(queries, cache, scale)
    if isinstance(cache, BatchTurboQuantKVCache):  # each row with its own causal mask
        outs = [
            turboquant_attention(queries[i : i + 1], row, scale, query_start=start)
            for i, (row, start) in enumerate(cache.rows_and_query_starts())
        ]
        return mx.concatenate(outs, axis=0) if len(outs) > 1 else outs[0]
    return None


def make_hooked_sdpa(original):
    """mlx-lm's scaled_dot_product_attention with TurboQuant caches routed to the twin
    (or the Metal kernels), and small prefill chunks over plain caches run unfused on CUDA
    (unfused_prefill.py: no cuDNN graph built per shape); every other call takes the original
    path untouched."""

    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        if sinks is None:
            out = turboquant_cache_attention(cache, queries, scale)
            if out is not None:
                return out
            if not hasattr(cache, "bits") and unfused_wanted(queries, keys):
                return unfused_attention(queries, keys, values, scale, mask)
        elif isinstance(cache, (TurboQuantKVCache, BatchTurboQuantKVCache)):
            raise ValueError("TurboQuant attention does not support attention sinks arrays")
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    setattr(scaled_dot_product_attention, _HOOK_MARK, True)
    return scaled_dot_product_attention


def install_turboquant_attention(model) -> list[str]:
    """Route attention over TurboQuant caches (and, on CUDA, small prefill chunks over plain
    caches: `make_hooked_sdpa`) in every mlx-lm module the model's layers come from.
    Idempotent; returns the module names patched (new ones only).

    mlx-lm model files import `scaled_dot_product_attention` by name from
    mlx_lm.models.base, so the name is wrapped in each such module (and in base); the
    wrapper falls through to the original for every other cache type."""
    if getattr(model, _HOOK_MARK, False):
        return []
    names = {type(m).__module__ for m in model.modules()} | {mlx_base.__name__}
    patched = []
    for name in sorted(names):
        module = sys.modules.get(name)
        current = getattr(module, "scaled_dot_product_attention", None)
        if current is None or getattr(current, _HOOK_MARK, False):
            continue
        module.scaled_dot_product_attention = make_hooked_sdpa(current)
        patched.append(name)
    object.__setattr__(model, _HOOK_MARK, True)  # a plain attribute, not a parameter
    return patched
