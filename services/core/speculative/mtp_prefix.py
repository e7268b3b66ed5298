"""An MTP layer's state kept beside a prefix-cache entry, so a prompt that reuses the prefix drafts
as if the layer had seen the prompt from its first token.

The MTP layer's cache slot i holds position i's hidden state paired with token i+1. For an entry of
n tokens the state keeps the n-1 slots and, when it is known, position n-1's hidden state (the
`dangling` one, waiting for the token after it). It rides at the end of the entry's cache list and
trims with it, so it always holds one slot less than the entry's positions. A trimmed entry loses
its dangling state (that position's hidden state was never kept); the sequence that resumes from it
then recomputes one prompt position more, whose forward gives that hidden state back.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import trim_prompt_cache


class MtpPrefixState:
    """The trimmable cache-list entry: the MTP layer's keys and values [B, heads, slots, D] and the
    dangling hidden state [1, 1, H] (or None)."""

    def __init__(self, keys: mx.array, values: mx.array, dangling: mx.array | None):
        self.keys = keys
        self.values = values
        self.dangling = dangling

    @property
    def slots(self) -> int:
        return self.keys.shape[2]

    @property
    def state(self) -> list[mx.array]:
        return [a for a in (self.keys, self.values, self.dangling) if a is not None]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(n, self.slots)
        if n > 0:
            self.keys, self.values = (
                self.keys[..., : self.slots - n, :],
                self.values[..., : self.slots - n, :],
            )
            self.dangling = None
        return n


def split_prefix_state(
    cache: list | None, cached: int, resumes: bool
) -> tuple[list | None, int, MtpPrefixState | None]:
    """A prefix-cache hit's (cache, cached positions) without the MTP state riding on it, and that
    state when the sequence `resumes` MTP drafting from it (else it is dropped). Without a dangling
    hidden state the cache gives up its last position, which the sequence computes again."""
    if not cache or not isinstance(cache[-1], MtpPrefixState):
        return cache, cached, None
    state = cache.pop()
    if not resumes:
        return cache, cached, None
    if state.dangling is None:
        if cached <= 1:
            return None, 0, None
        trim_prompt_cache(cache, 1)
        cached -= 1
    return cache, cached, state
