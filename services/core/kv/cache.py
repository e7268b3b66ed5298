"""`TurboQuantKVCache`: mlx-lm's KV cache protocol over a compressed store.

A sequence's tokens live in three runs, in position order:
  sinks (the first `sink_tokens`, exact) | compressed (TurboQuant codes) | recent (exact)
New tokens enter `recent`; once it holds `recent_window + block_size` tokens, the
oldest whole blocks are compressed. Exact runs keep the model's dtype, as mlx-lm's
KVCache does. Attention over this cache is `services.core.kv.attention`, reached from
mlx-lm's unchanged attention code through `install_turboquant_attention`.
"""

from __future__ import annotations

import copy
from functools import lru_cache

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache, create_attention_mask

from services.core.kv.codec import TurboQuantCodec
from services.core.kv.compressed import CompressedTokens
from services.core.kv.settings import KVCacheSettings


@lru_cache(maxsize=512)
def shared_codec(dim: int, bits: int, qjl: bool, seed: int) -> TurboQuantCodec:
    """Codecs hold only constants: one per (layer seed, shape) serves every sequence."""
    return TurboQuantCodec(dim, bits, qjl, seed)


def _cat(a: mx.array | None, b: mx.array) -> mx.array:
    return b if a is None else mx.concatenate([a, b], axis=2)


def _join(a: CompressedTokens | None, b: CompressedTokens) -> CompressedTokens:
    return b if a is None else a.concat(b)


def _length(a) -> int:
    if a is None:
        return 0
    return a.length if isinstance(a, CompressedTokens) else a.shape[2]


def _encode(codec: TurboQuantCodec, x: mx.array) -> CompressedTokens:
    from services.core.kv.metal_attention import kernels_ready

    if kernels_ready():  # Apple GPU: norm, rotate, quantize and pack in one kernel
        from metal.kernels import pack

        return CompressedTokens(*pack(codec, x))
    return codec.encode(x)


class TurboQuantKVCache(_BaseCache):
    """KV cache of one layer for one sequence (batch 1, or several rows of equal length).

    Contract: `update_and_fetch(keys, values)` stores [B, H, N, D] keys (after RoPE) and
    values and returns them unchanged — the attention hook reads the cache itself, so no
    decompressed copy is ever made. `offset` is the number of tokens stored; `trim(n)`
    drops the newest n (from whichever run holds them); `nbytes` counts the bytes held,
    compressed runs at their packed size. Arrays are never modified in place, so a
    copy (`copy.deepcopy`, `extract`, `merge`) may share them safely.
    """

    def __init__(self, settings: KVCacheSettings, layer: int):
        self.settings = settings
        self.layer = layer
        self.sink_keys = self.sink_values = None
        self.compressed_keys: CompressedTokens | None = None
        self.compressed_values: CompressedTokens | None = None
        self.recent_keys = self.recent_values = None
        self.offset = 0
        self.key_codec: TurboQuantCodec | None = None
        self.value_codec: TurboQuantCodec | None = None

    # ---- writing --------------------------------------------------------------------

    def _codecs(self, keys: mx.array, values: mx.array) -> None:
        s, seed = self.settings, self.settings.seed + 1000 * self.layer
        self.key_codec = shared_codec(keys.shape[-1], s.key_bits, s.key_qjl, seed)
        self.value_codec = shared_codec(values.shape[-1], s.value_bits, False, seed + 1)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if self.key_codec is None:
            self._codecs(keys, values)
        n = keys.shape[2]
        to_sinks = max(0, min(n, self.settings.sink_tokens - _length(self.sink_keys)))
        if to_sinks:
            self.sink_keys = _cat(self.sink_keys, keys[:, :, :to_sinks])
            self.sink_values = _cat(self.sink_values, values[:, :, :to_sinks])
        if to_sinks < n:
            self.recent_keys = _cat(self.recent_keys, keys[:, :, to_sinks:])
            self.recent_values = _cat(self.recent_values, values[:, :, to_sinks:])
        self.offset += n
        self._compress_aged()
        return keys, values

    def _compress_aged(self) -> None:
        s = self.settings
        excess = _length(self.recent_keys) - s.recent_window
        if excess < s.block_size:
            return
        n = (excess // s.block_size) * s.block_size
        self.compressed_keys = _join(
            self.compressed_keys, _encode(self.key_codec, self.recent_keys[:, :, :n])
        )
        self.compressed_values = _join(
            self.compressed_values, _encode(self.value_codec, self.recent_values[:, :, :n])
        )
        self.recent_keys = self.recent_keys[:, :, n:]
        self.recent_values = self.recent_values[:, :, n:]

    # ---- mlx-lm cache protocol ------------------------------------------------------

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.offset == 0

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        left = n
        for run in ("recent", "compressed", "sink"):
            k_name, v_name = f"{run}_keys", f"{run}_values"
            keys, values = getattr(self, k_name), getattr(self, v_name)
            length = _length(keys)
            cut = min(left, length)
            if cut == 0:
                continue
            keep = length - cut
            if keep == 0:
                keys = values = None
            elif run == "compressed":
                keys, values = keys.tokens(0, keep), values.tokens(0, keep)
            else:
                keys, values = keys[:, :, :keep], values[:, :, :keep]
            setattr(self, k_name, keys)
            setattr(self, v_name, values)
            left -= cut
        self.offset -= n
        return n

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        # The attention hook builds its own mask from positions; this keeps the
        # contract for any model code that inspects the mask.
        return create_attention_mask(
            N, offset=self.offset, return_array=return_array, window_size=window_size
        )

    @classmethod
    def merge(cls, caches):
        from services.core.kv.batch_cache import BatchTurboQuantKVCache

        return BatchTurboQuantKVCache.merge(caches)

    @property
    def state(self) -> list[mx.array]:
        arrays = []
        for item in (
            self.sink_keys,
            self.sink_values,
            self.compressed_keys,
            self.compressed_values,
            self.recent_keys,
            self.recent_values,
        ):
            if isinstance(item, CompressedTokens):
                arrays.extend(item.arrays())
            elif item is not None:
                arrays.append(item)
        return arrays

    @state.setter
    def state(self, value) -> None:
        raise NotImplementedError(
            "TurboQuantKVCache cannot be rebuilt from bare arrays; copy it with copy.deepcopy"
        )

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)

    @property
    def compressed_length(self) -> int:
        return _length(self.compressed_keys)

    def __deepcopy__(self, memo):
        # Arrays are immutable here and codecs are shared constants: a shallow copy is
        # a full, independent copy as far as any later update or trim is concerned.
        return copy.copy(self)
