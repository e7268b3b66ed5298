"""TurboQuant KV cache: compressed keys/values with attention in the rotated domain.

Public contract used by the engine: KV_CACHE_KINDS, KVCacheSettings, make_kv_cache,
install_turboquant_attention, kv_cache_bytes (and the cache classes themselves).

Names resolve on first use, so a light submodule (the CLI flags) imports without mlx-lm.
"""

from importlib import import_module

_HOMES = {
    "install_turboquant_attention": "sdpa_hook",
    "turboquant_attention": "attention",
    "BatchTurboQuantKVCache": "batch_cache",
    "TurboQuantKVCache": "cache",
    "kv_cache_bytes": "factory",
    "make_kv_cache": "factory",
    "KV_CACHE_KINDS": "settings",
    "PAPER_SETTINGS": "settings",
    "KVCacheSettings": "settings",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{_HOMES[name]}"), name)
    globals()[name] = value  # later lookups find it without coming here
    return value
