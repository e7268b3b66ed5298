"""Reuse the KV cache of prompt prefixes across requests (system prompts, earlier chat turns).

A thin layer over mlx-lm's own `LRUPromptCache` (a token trie with LRU eviction under a byte
budget, the one mlx-lm's server uses): it adds the counters core reports and keeps caches of
different kinds (fp16, turboquant) apart by using the kind as the trie's model key.

Entries are per-sequence caches. A lookup returns a deep copy, trimmed to the shared prefix, so the
stored entry is never touched by the sequence that reuses it.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import LRUPromptCache

# More entries than any sane budget holds; the byte budget is the real limit.
MAX_ENTRIES = 4096


@dataclass
class PrefixCacheCounters:
    lookups: int = 0
    hits: int = 0
    hit_tokens: int = 0


class PrefixCache:
    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.counters = PrefixCacheCounters()
        self._lru = LRUPromptCache(max_size=MAX_ENTRIES, max_bytes=max(budget_bytes, 0))

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    @property
    def entries(self) -> int:
        return len(self._lru)

    @property
    def nbytes(self) -> int:
        return self._lru.nbytes

    def lookup(self, kind: str, prompt: list[int]) -> tuple[list | None, int]:
        """(a private copy of the cache covering the longest reusable prefix, its length).

        At least the prompt's last token is always left to compute: generation starts from
        the logits of a forward pass."""
        if not self.enabled or len(prompt) < 2:
            return None, 0
        self.counters.lookups += 1
        cache, rest = self._lru.fetch_nearest_cache(kind, prompt[:-1])
        if cache is None:
            return None, 0
        cached = len(prompt) - 1 - len(rest)
        if cached <= 0:
            return None, 0
        self.counters.hits += 1
        self.counters.hit_tokens += cached
        return cache, cached

    def store(self, kind: str, tokens: list[int], cache: list) -> None:
        """Keep `cache`, which holds the KV of exactly `tokens`, for later requests."""
        if not self.enabled or not tokens or not cache:
            return
        # An extracted cache is a lazy slice of its batch's KV buffers: evaluated now, the entry
        # holds only its own bytes (what the budget counts), not the whole batch's buffers.
        mx.eval([a for _, a in tree_flatten([layer.state for layer in cache]) if isinstance(a, mx.array)])
        self._lru.insert_cache(kind, list(tokens), cache)
