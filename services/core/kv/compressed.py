"""`CompressedTokens`: the packed form of a run of tokens of one cache tensor.

Everything is laid out [batch, kv_heads, tokens, ...] like mlx-lm's caches, so runs
concatenate and slice along axis 2. Arrays are never written in place (every change
builds a new array), which is why copies of a cache may share them.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class CompressedTokens:
    """norm: float16 [B, H, T] (|x|); codes: uint8 [B, H, T, bytes], the bit planes of the
    codebook indices of the rotated unit vector (services.core.kv.packing); for QJL keys also residual_norm float16
    [B, H, T] and qjl_signs uint8 [B, H, T, P/8] (bit i = sign(S r)_i >= 0)."""

    norm: mx.array
    codes: mx.array
    residual_norm: mx.array | None = None
    qjl_signs: mx.array | None = None

    @property
    def length(self) -> int:
        return self.norm.shape[2]

    def arrays(self) -> list[mx.array]:
        extra = [a for a in (self.residual_norm, self.qjl_signs) if a is not None]
        return [self.norm, self.codes, *extra]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    def _map(self, fn) -> CompressedTokens:
        return CompressedTokens(
            fn(self.norm),
            fn(self.codes),
            None if self.residual_norm is None else fn(self.residual_norm),
            None if self.qjl_signs is None else fn(self.qjl_signs),
        )

    def tokens(self, start: int, stop: int) -> CompressedTokens:
        return self._map(lambda a: a[:, :, start:stop])

    def rows(self, index) -> CompressedTokens:
        return self._map(lambda a: a[index])

    def concat(self, other: CompressedTokens) -> CompressedTokens:
        pairs = zip(self.arrays(), other.arrays(), strict=True)
        joined = [mx.concatenate([a, b], axis=2) for a, b in pairs]
        return _rebuild(self, joined)


def _rebuild(template: CompressedTokens, arrays: list[mx.array]) -> CompressedTokens:
    residual = arrays[2] if template.residual_norm is not None else None
    signs = arrays[-1] if template.qjl_signs is not None else None
    return CompressedTokens(arrays[0], arrays[1], residual, signs)
