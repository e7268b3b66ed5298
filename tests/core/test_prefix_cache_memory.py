"""The prefix cache holds what its budget counts: a stored entry, cut from a batch's KV buffers,
keeps only its own bytes alive, not the whole batch's (which made core's memory grow without bound
under load)."""

from __future__ import annotations

import gc

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from services.core.prefix_cache import PrefixCache

TOKENS, HEADS, DIM, SEQUENCES = 2048, 8, 64, 4


def _batch() -> BatchKVCache:
    caches = []
    for _ in range(SEQUENCES):
        cache = KVCache()
        cache.update_and_fetch(*(mx.random.normal((1, HEADS, TOKENS, DIM)) for _ in range(2)))
        caches.append(cache)
    batch = BatchKVCache.merge(caches)
    mx.eval(batch.keys, batch.values)
    return batch


def test_a_stored_entry_keeps_only_its_own_bytes():
    gc.collect()
    before = mx.get_active_memory()
    batch = _batch()
    batch_bytes = mx.get_active_memory() - before
    prefix = PrefixCache(budget_bytes=1 << 30)
    prefix.store("fp16", list(range(TOKENS)), [batch.extract(0)])  # as the engine stores a finished prompt
    del batch
    gc.collect()
    held = mx.get_active_memory() - before
    assert prefix.nbytes == 2 * HEADS * TOKENS * DIM * 4
    assert held <= prefix.nbytes * 1.1, (held, prefix.nbytes, batch_bytes)


def test_a_stored_entry_still_serves_its_prefix():
    batch = _batch()
    entry = batch.extract(1)
    want = mx.array(entry.keys)
    prefix = PrefixCache(budget_bytes=1 << 30)
    prefix.store("fp16", list(range(TOKENS)), [entry])
    cache, cached = prefix.lookup("fp16", list(range(TOKENS)) + [7])
    assert cached == TOKENS
    assert mx.array_equal(cache[0].keys[..., :TOKENS, :], want).item()
