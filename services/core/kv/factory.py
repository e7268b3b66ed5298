"""Per-sequence cache construction and byte accounting for the engine."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from services.core.kv import kernel_select  # noqa: F401 - caches find the kernels through it
from services.core.kv.cache import TurboQuantKVCache
from services.core.kv.sdpa_hook import install_turboquant_attention
from services.core.kv.settings import KV_CACHE_KINDS, KVCacheSettings
from services.core.kv.unfused_prefill import cuda_available


def make_kv_cache(model, kind: str, settings: KVCacheSettings | None = None) -> list:
    """The per-layer caches for one new sequence.

    "fp16": exactly mlx-lm's make_prompt_cache(model). "turboquant": the same list with
    every plain KVCache of a full-attention layer replaced by a TurboQuantKVCache; other
    caches (e.g. qwen3_5_moe's ArraysCache for Gated DeltaNet layers, rotating caches of
    sliding-window layers, and the layers of `turboquant_unsupported_layers`) stay as mlx-lm
    makes them."""
    if kind not in KV_CACHE_KINDS:
        raise ValueError(f"unknown KV cache kind {kind!r}; expected one of {', '.join(KV_CACHE_KINDS)}")
    caches = make_prompt_cache(model)
    # Idempotent. TurboQuant caches are useless without the hook; plain caches need it only where
    # CUDA is (small prefill chunks run unfused there, kv/unfused_prefill.py): elsewhere every
    # attention call would pass through it for nothing.
    if kind != "fp16" or cuda_available():
        install_turboquant_attention(model)
    if kind == "fp16":
        return caches
    settings = settings or KVCacheSettings()
    plain = turboquant_unsupported_layers(model)
    return [
        TurboQuantKVCache(settings, layer) if type(c) is KVCache and layer not in plain else c
        for layer, c in enumerate(caches)
    ]


def turboquant_unsupported_layers(model) -> frozenset[int]:
    """Indices of the layers whose attention TurboQuant's cannot stand in for; they keep
    mlx-lm's cache under every kind.

    - Multi-head latent attention (DeepSeek's MLA; the attention module has a `kv_lora_rank`):
      its cache holds the compressed latent and the rotary key, not per-head keys and values, and
      its attention derives the keys from the latent and passes the rotary scores as the mask.
      The latent is already a compression of the keys and values.
    - Attention with learned sinks (gpt-oss; the module holds a `sinks` array), which
      TurboQuant's attention does not compute.
    - Chunked attention (Llama 4's RoPE layers; `attends_in_chunks`), whose mask hides earlier
      chunks: TurboQuant's attention is plain causal."""
    found = getattr(model, _UNSUPPORTED_MARK, None)
    if found is None:
        found = frozenset(
            i
            for i, layer in enumerate(getattr(model, "layers", ()))
            if any(
                hasattr(module, "kv_lora_rank")
                or isinstance(module.get("sinks"), mx.array)
                or getattr(module, "attends_in_chunks", False)
                for module in layer.modules()
            )
        )
        object.__setattr__(model, _UNSUPPORTED_MARK, found)  # a plain attribute, not a parameter
    return found


_UNSUPPORTED_MARK = "_moe_mesh_turboquant_unsupported_layers"


def kv_cache_bytes(caches) -> int:
    """Bytes held by a list of caches (compressed runs at their packed size)."""
    return sum(c.nbytes for c in caches)
