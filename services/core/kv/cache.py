"""`TurboQuantKVCache`: mlx-lm's KV cache protocol over a compressed store.

A sequence's tokens live in three runs, in position order:
  sinks (the first `sink_tokens`, exact) | compressed (TurboQuant codes) | recent (exact)
New tokens enter `recent`; once it holds `recent_window + block_size` tokens, the
oldest whole blocks are compressed (on GPUs, a prefill chunk's only after its attention
ran: see CHUNK_INVARIANT_PREFILL). Exact runs keep the model's dtype, as mlx-lm's
KVCache does. Attention over this cache is `services.core.kv.attention`, reached from
mlx-lm's unchanged attention code through `install_turboquant_attention` (sdpa_hook.py).
"""

from __future__ import annotations

import copy
from functools import lru_cache

import mlx.core as mx
from mlx_lm.models.cache import create_attention_mask

from services.common.mlx_lm_adapter import BaseCache
from services.core.kv import kernel_slot
from services.core.kv.codec import TurboQuantCodec
from services.core.kv.compressed import CompressedTokens
from services.core.kv.settings import KVCacheSettings
from services.core.kv.token_buffer import TokenBuffer, token_length

# Where a prefill chunk's queries see the tokens the chunk itself compresses as they would had the
# prompt come one token at a time (attention._attention_by_boundary), so that TurboQuant's tokens
# do not depend on chunking. On CPUs it is also the faster prefill. On GPUs, where the pacer keeps
# 512-token chunks unless the machine is loaded, one fused causal call over the runs as stored is
# kept: there the per-position view costs prefill a factor of several (docs/benchmarks.md,
# TurboQuant speed).
CHUNK_INVARIANT_PREFILL = mx.default_device() == mx.cpu
# Elsewhere a multi-token update's tokens age only after its attention call ran (`age`, called by
# attention.turboquant_attention): every query of the chunk then sees at least its own recent
# window exact (the window before the chunk plus the chunk's tokens up to it), as a query does when
# tokens come one at a time, yet the chunk still takes one fused causal call over the runs as
# stored. Without it a 512-token chunk's early queries saw their newest tokens compressed: the demo
# model lost ~13 % perplexity at window 128, against +0.50 % with it and +1.07 % token by token
# (docs/benchmarks.md, TurboQuant).


@lru_cache(maxsize=512)
def shared_codec(dim: int, bits: int, qjl: bool, seed: int) -> TurboQuantCodec:
    """Codecs hold only constants: one per (layer seed, shape) serves every sequence."""
    return TurboQuantCodec(dim, bits, qjl, seed)


def _cat(a: mx.array | None, b: mx.array) -> mx.array:
    return b if a is None else mx.concatenate([a, b], axis=2)


def _shifted(x: mx.array, offset: mx.array | None) -> mx.array:
    return x if offset is None else (x.astype(mx.float32) - offset).astype(x.dtype)


def _encode(codec: TurboQuantCodec, x: mx.array) -> CompressedTokens:
    kernels = kernel_slot.current_backend()
    if kernels is not None and hasattr(kernels, "pack"):  # norm, rotate, quantize, pack in one kernel
        return CompressedTokens(*kernels.pack(codec, x))
    return codec.encode(x)


class TurboQuantKVCache(BaseCache):
    """KV cache of one layer for one sequence (batch 1, or several rows of equal length).

    Contract: `update_and_fetch(keys, values)` stores [B, H, N, D] keys (after RoPE) and
    values and returns them unchanged — the attention hook reads the cache itself, so no
    decompressed copy is ever made. `offset` is the number of tokens stored; `trim(n)`
    drops the newest n (from whichever run holds them); `nbytes` counts the bytes held,
    compressed runs at their packed size (buffers count with their spare room, as
    mlx-lm's KVCache does). Arrays are never modified in place, so a copy
    (`copy.deepcopy`, `extract`, `merge`) may share them safely.

    The compressed run and the recent window live in `TokenBuffer`s (preallocated,
    grown in steps): an append writes only the new tokens and compressing a block never
    re-packs the run. `compressed_keys`, `recent_keys`, ... are views of the filled part.
    """

    def __init__(self, settings: KVCacheSettings, layer: int):
        self.settings = settings
        self.layer = layer
        self.sink_keys = self.sink_values = None
        self.compressed_key_buffer: TokenBuffer | None = None  # CompressedTokens.arrays()
        self.compressed_value_buffer: TokenBuffer | None = None
        self.recent_buffer: TokenBuffer | None = None  # (keys, values), model dtype
        self.offset = 0
        self.key_codec: TurboQuantCodec | None = None
        self.value_codec: TurboQuantCodec | None = None
        # what every stored key / value has subtracted, float32 [B, H, 1, D], set when the
        # first block is compressed (None: nothing subtracted)
        self.key_offset: mx.array | None = None
        self.value_offset: mx.array | None = None
        # The tokens the last update compressed, as they were stored exact (keys, values), and
        # the position of the first: that update's queries still see the ones younger than their
        # own window exact (attention._stored_attention), so a prompt's tokens do not depend on
        # how it was cut into chunks. Cleared by the next update, trim and copies; kept only where
        # CHUNK_INVARIANT_PREFILL.
        self.just_aged: tuple[mx.array, mx.array, int] | None = None
        # the last update appended its tokens without compressing any (see CHUNK_INVARIANT_PREFILL):
        # `age` compresses what exceeds the window once that update's attention ran
        self.aging_deferred = False

    # ---- writing --------------------------------------------------------------------

    def _codecs(self, keys: mx.array, values: mx.array) -> None:
        s, seed = self.settings, self.settings.seed + 1000 * self.layer
        self.key_codec = shared_codec(keys.shape[-1], s.key_bits, s.key_qjl, seed)
        self.value_codec = shared_codec(values.shape[-1], s.value_bits, False, seed + 1)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if self.key_codec is None:
            self._codecs(keys, values)
        returned, n = (keys, values), keys.shape[2]
        self.just_aged = None
        self.age()  # in case the last update's attention did not come through the hook
        keys, values = self._centered(keys, values)
        to_sinks = max(0, min(n, self.settings.sink_tokens - token_length(self.sink_keys)))
        if to_sinks:
            self.sink_keys = _cat(self.sink_keys, keys[:, :, :to_sinks])
            self.sink_values = _cat(self.sink_values, values[:, :, :to_sinks])
        if to_sinks < n:
            defer = n > 1 and not CHUNK_INVARIANT_PREFILL
            if to_sinks:  # (a slice of everything is one more op per array and step)
                keys, values = keys[:, :, to_sinks:], values[:, :, to_sinks:]
            self._append_recent(keys, values, defer_aging=defer)
        self.offset += n
        return returned

    # ---- centering (KVCacheSettings.center_keys / center_values) ---------------------

    def _centered(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return _shifted(keys, self.key_offset), _shifted(values, self.value_offset)

    def _start_centering(self) -> None:
        """Fixes the offsets as the means of the window's first block (the first to be compressed)
        and re-stores every exact token minus them (a one-time pass over sinks and window), so
        that all tokens of the sequence share one shift. Why a shift is free: scores
        q.(k - mu) = q.k - q.mu move by one constant per query, which the softmax ignores; the
        weights sum to 1, so the weighted sum of v - nu is the output minus nu, added back once
        (`value_offset`)."""
        s, recent = self.settings, self.recent_buffer

        def first_mean(which: int) -> mx.array:
            # the first block, however many blocks this update ages: the same shift for every
            # way of cutting the sequence into updates
            run = recent.views()[which][:, :, : s.block_size]
            return mx.mean(run.astype(mx.float32), axis=2, keepdims=True)

        if s.center_keys:
            self.key_offset = first_mean(0)
        if s.center_values:
            self.value_offset = first_mean(1)
        if self.sink_keys is not None:
            self.sink_keys, self.sink_values = self._centered(self.sink_keys, self.sink_values)
        self.recent_buffer = self._new_recent(self._centered(*recent.views()))

    @property
    def centering(self) -> bool:
        return self.key_offset is not None or self.value_offset is not None

    def _append_recent(self, keys: mx.array, values: mx.array, defer_aging: bool = False) -> None:
        """New tokens enter the window, then `age` compresses the whole blocks beyond it (with
        defer_aging, once this update's attention ran)."""
        recent = self.recent_buffer
        self.recent_buffer = (
            recent.appended((keys, values)) if recent is not None else self._new_recent((keys, values))
        )
        self.aging_deferred = True
        if not defer_aging:
            self.age()

    def age(self) -> None:
        """Compresses the whole blocks the window holds beyond recent_window tokens, if the last
        update left any (see CHUNK_INVARIANT_PREFILL), and gives the window's spare room back."""
        if not self.aging_deferred:
            return
        self.aging_deferred = False
        s = self.settings
        aged = max(0, token_length(self.recent_buffer) - s.recent_window) // s.block_size * s.block_size
        if not aged:
            return
        if (s.center_keys or s.center_values) and not self.centering:
            self._start_centering()
        recent, limit = self.recent_buffer, s.recent_window + s.block_size
        old_k, old_v = (a[:, :, :aged] for a in recent.arrays)
        if recent.capacity <= limit:  # decode steps: shift within the same arrays
            self.recent_buffer = recent.without_first(aged)
        else:  # a chunk outgrew the window's arrays: keep only what stays, at the window's size
            self.recent_buffer = self._new_recent(tuple(a[:, :, aged : recent.length] for a in recent.arrays))
        if CHUNK_INVARIANT_PREFILL:
            self.just_aged = (old_k, old_v, token_length(self.sink_keys) + self.compressed_length)
        self._append_compressed(_encode(self.key_codec, old_k), _encode(self.value_codec, old_v))

    def _new_recent(self, arrays) -> TokenBuffer:
        s = self.settings
        return TokenBuffer.of(arrays, limit=s.recent_window + s.block_size)

    def _append_compressed(self, keys: CompressedTokens, values: CompressedTokens) -> None:
        if self.compressed_key_buffer is None:
            self.compressed_key_buffer = TokenBuffer.of(keys.arrays())
            self.compressed_value_buffer = TokenBuffer.of(values.arrays())
        else:
            self.compressed_key_buffer = self.compressed_key_buffer.appended(keys.arrays())
            self.compressed_value_buffer = self.compressed_value_buffer.appended(values.arrays())

    # ---- views ----------------------------------------------------------------------

    @property
    def compressed_keys(self) -> CompressedTokens | None:
        return _tokens(self.compressed_key_buffer)

    @property
    def compressed_values(self) -> CompressedTokens | None:
        return _tokens(self.compressed_value_buffer)

    @property
    def recent_keys(self) -> mx.array | None:
        return None if self.recent_buffer is None else self.recent_buffer.views()[0]

    @property
    def recent_values(self) -> mx.array | None:
        return None if self.recent_buffer is None else self.recent_buffer.views()[1]

    # ---- mlx-lm cache protocol ------------------------------------------------------

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.offset == 0

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drops the newest n tokens: from the window first, then the compressed run, then
        the sinks. Trimmed buffers are cut to size, so the memory is given back."""
        n = min(self.offset, n)
        self.just_aged = None
        cut = min(n, token_length(self.recent_buffer))
        if cut:
            self.recent_buffer = self.recent_buffer.truncated(self.recent_buffer.length - cut)
        left = n - cut
        cut = min(left, self.compressed_length)
        if cut:
            keep = self.compressed_length - cut
            key_buffer, value_buffer = self.compressed_key_buffer, self.compressed_value_buffer
            self.compressed_key_buffer = key_buffer.truncated(keep) if keep else None
            self.compressed_value_buffer = value_buffer.truncated(keep) if keep else None
        left -= cut
        if left:
            keep = token_length(self.sink_keys) - left
            self.sink_keys = self.sink_keys[:, :, :keep] if keep else None
            self.sink_values = self.sink_values[:, :, :keep] if keep else None
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
        arrays = [a for a in (self.sink_keys, self.sink_values) if a is not None]
        for buffer in (self.compressed_key_buffer, self.compressed_value_buffer, self.recent_buffer):
            if buffer is not None:
                arrays.extend(buffer.views())
        return arrays

    @state.setter
    def state(self, value) -> None:
        raise NotImplementedError(
            "TurboQuantKVCache cannot be rebuilt from bare arrays; copy it with copy.deepcopy"
        )

    @property
    def nbytes(self) -> int:
        exact = sum(a.nbytes for a in (self.sink_keys, self.sink_values) if a is not None)
        buffers = (self.compressed_key_buffer, self.compressed_value_buffer, self.recent_buffer)
        return exact + sum(b.nbytes for b in buffers if b is not None)

    @property
    def compressed_length(self) -> int:
        return token_length(self.compressed_key_buffer)

    @property
    def kv_heads(self) -> int:
        """KV heads, from whichever run holds tokens (the attention paths need it for GQA)."""
        exact = self.sink_keys if self.sink_keys is not None else self.recent_keys
        return exact.shape[1] if exact is not None else self.compressed_keys.norm.shape[1]

    def __deepcopy__(self, memo):
        # Arrays are immutable here and codecs are shared constants: a shallow copy is
        # a full, independent copy as far as any later update or trim is concerned.
        twin = copy.copy(self)
        twin.just_aged = None  # transient (one attention call): a stored copy need not hold it
        return twin


def _tokens(buffer: TokenBuffer | None) -> CompressedTokens | None:
    if buffer is None:
        return None
    arrays = buffer.views()
    if len(arrays) == 2:
        return CompressedTokens(*arrays)
    return CompressedTokens(arrays[0], arrays[1], arrays[2], arrays[3])
