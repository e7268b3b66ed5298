"""TurboQuant KV cache: compressed keys/values with attention in the rotated domain.

Public contract used by the engine: KV_CACHE_KINDS, KVCacheSettings, make_kv_cache,
install_turboquant_attention, kv_cache_bytes (and the cache classes themselves).
"""

from services.core.kv.attention import install_turboquant_attention, turboquant_attention
from services.core.kv.batch_cache import BatchTurboQuantKVCache
from services.core.kv.cache import TurboQuantKVCache
from services.core.kv.factory import kv_cache_bytes, make_kv_cache
from services.core.kv.settings import KV_CACHE_KINDS, PAPER_SETTINGS, KVCacheSettings

__all__ = [
    "KV_CACHE_KINDS",
    "BatchTurboQuantKVCache",
    "KVCacheSettings",
    "PAPER_SETTINGS",
    "TurboQuantKVCache",
    "install_turboquant_attention",
    "kv_cache_bytes",
    "make_kv_cache",
    "turboquant_attention",
]
