"""`TokenBuffer`: a run of tokens of one cache tensor in preallocated arrays.

Why: appending by concatenation copies the whole run on every append (the compressed run
of a 16K context once per block, the exact window once per decode step). Like mlx-lm's
KVCache, the arrays here have room for more tokens and grow in steps, so an append
writes only the new tokens. Attention reads whole buffers with the filled length as a
mask (shapes then change once per step of growth, which keeps compiled graphs reusable)
or sliced views (`views`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx


@lru_cache(maxsize=4096)
def token_index(n: int) -> mx.array:
    """mx.array([n]) (int32), made once: every layer of a step appends at the same index,
    and on a GPU each new small array is a host-to-device copy."""
    return mx.array([n], mx.int32)


def _as(x: mx.array, dtype) -> mx.array:
    # astype to the same dtype is still one more op per array and step (bench/kv_update.py)
    return x if x.dtype == dtype else x.astype(dtype)


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


@dataclass(frozen=True)
class TokenBuffer:
    """Arrays [B, H, capacity, ...] that share the token axis 2; tokens [0, length) are
    filled, the rest are zeros (so a masked-out slot still decodes to finite numbers).

    Immutable: every change returns a new TokenBuffer built with mx.slice_update or a
    copy, never a write into an array another buffer may hold, so copies of a cache can
    share buffers (MLX reuses the old memory in place when nothing else refers to it).
    `limit`, when set, caps the capacity a step of growth rounds up to (a window that
    never holds more than `limit` tokens should not reserve more)."""

    arrays: tuple[mx.array, ...]
    length: int
    step: int = 256
    limit: int | None = None

    @classmethod
    def of(cls, arrays, step: int = 256, limit: int | None = None) -> TokenBuffer:
        arrays = tuple(arrays)
        empty = cls(tuple(mx.zeros((*a.shape[:2], 0, *a.shape[3:]), a.dtype) for a in arrays), 0, step, limit)
        return empty.appended(arrays)

    @property
    def capacity(self) -> int:
        return self.arrays[0].shape[2]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    def views(self) -> tuple[mx.array, ...]:
        if self.length == self.capacity:
            return self.arrays
        return tuple(a[:, :, : self.length] for a in self.arrays)

    def _new_capacity(self, needed: int) -> int:
        grown = _round_up(needed, self.step)
        return grown if self.limit is None else max(needed, min(grown, self.limit))

    def appended(self, new) -> TokenBuffer:
        new = tuple(new)
        n = new[0].shape[2]
        end = self.length + n
        if end <= self.capacity:
            start = token_index(self.length)
            arrays = tuple(
                mx.slice_update(a, _as(u, a.dtype), start, (2,))
                for a, u in zip(self.arrays, new, strict=True)
            )
            return TokenBuffer(arrays, end, self.step, self.limit)
        spare = self._new_capacity(end) - end
        arrays = []
        for old, update in zip(self.views(), new, strict=True):
            parts = [p for p in (old, _as(update, old.dtype)) if p.shape[2]]
            if spare:
                parts.append(mx.zeros((*update.shape[:2], spare, *update.shape[3:]), old.dtype))
            arrays.append(mx.concatenate(parts, axis=2) if len(parts) > 1 else parts[0])
        return TokenBuffer(tuple(arrays), end, self.step, self.limit)

    def truncated(self, length: int) -> TokenBuffer:
        """The first `length` tokens, in arrays of exactly that size (trimming frees memory)."""
        return TokenBuffer(tuple(a[:, :, :length] for a in self.arrays), length, self.step, self.limit)

    def without_first(self, n: int) -> TokenBuffer:
        """Drops the oldest n tokens; the rest move to the front of same-size arrays."""
        keep = self.length - n
        arrays = []
        for a in self.arrays:
            rest = a[:, :, n : self.length]
            pad = self.capacity - keep
            if pad:
                rest = mx.concatenate([rest, mx.zeros((*a.shape[:2], pad, *a.shape[3:]), a.dtype)], axis=2)
            arrays.append(rest)
        return TokenBuffer(tuple(arrays), keep, self.step, self.limit)


def token_length(run) -> int:
    """Tokens in one run of a cache: a TokenBuffer, a [B, H, N, D] array, or None (empty)."""
    if run is None:
        return 0
    return run.length if isinstance(run, TokenBuffer) else run.shape[2]
