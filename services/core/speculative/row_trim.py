"""Trimming each row of a batch's KV cache by its own count: the drafts it did not accept.

A `BatchKVCache` keeps every row right-aligned at one write index, so it can only trim all rows
alike. Rows that must drop more than the least are made right-aligned again by moving their
oldest m tokens into the garbage slots at the end and widening their left padding; m is at most
the draft length, so no row is ever copied whole. Attention does not depend on the order of the
cached keys (their positions are in them, by RoPE), but a cache taken out for reuse must be in
token order again: `RowOrder` records the moves and `in_token_order` undoes them.

`BatchTurboQuantKVCache` keeps one cache per row, each trimmed on its own.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache

from services.common.mlx_lm_adapter import write_index
from services.core.kv.batch_cache import BatchTurboQuantKVCache
from services.core.speculative.recurrent_rows import RecurrentRows

TRIMMABLE = (BatchKVCache, BatchTurboQuantKVCache)


def can_trim_rows(caches: list, recurrent: RecurrentRows | None = None) -> bool:
    """Only these exact types, and recurrent layers that `recurrent` replays: a sliding window or
    another recurrent state cannot give tokens back."""
    replayed = recurrent.mixers if recurrent is not None else {}
    return bool(caches) and all(
        type(c) in TRIMMABLE or (type(c) is ArraysCache and i in replayed) for i, c in enumerate(caches)
    )


class RowOrder:
    """Per row (by uid): the token index held by each cached slot, for rows whose slots were
    moved; rows never moved are in token order and are not listed."""

    def __init__(self):
        self._slots: dict[int, list[int]] = {}

    def moved(self, uid: int, length: int, garbage: int, move: int) -> None:
        """Row `uid` holds `length` slots, the last `garbage` of them dropped drafts; its first
        `move` slots went to the end of what it keeps."""
        slots = self._slots.get(uid, [])
        slots = slots + list(range(len(slots), length))  # slots written since the last move
        kept = length - garbage
        self._slots[uid] = slots[move:kept] + slots[:move]

    def trimmed(self, uid: int, length: int) -> None:
        """Row `uid` now holds `length` slots (a trim from the end)."""
        if uid in self._slots:
            del self._slots[uid][length:]

    def forget(self, keep) -> None:
        for uid in [u for u in self._slots if u not in keep]:
            del self._slots[uid]

    def in_token_order(self, uid: int, cache: list) -> list:
        """`cache` (the row's extracted per-layer caches) with its slots back in token order."""
        slots = self._slots.get(uid)
        if slots is None:
            return cache
        moved = sorted(range(len(slots)), key=slots.__getitem__)
        for layer in cache:
            if isinstance(layer, KVCache) and layer.keys is not None:
                length = layer.offset
                index = mx.array((moved + list(range(len(slots), length)))[:length])
                layer.keys = mx.take(layer.keys[..., :length, :], index, axis=2)
                layer.values = mx.take(layer.values[..., :length, :], index, axis=2)
        return cache


def trim_rows(
    caches: list, drop: list[int], uids: list[int], order: RowOrder, recurrent: RecurrentRows | None = None
) -> None:
    """Drop the newest `drop[i]` tokens of row i in every layer's cache; the recurrent layers'
    rows by replaying the forward `recurrent` was armed for."""
    if recurrent is not None:
        recurrent.settle(caches, drop)
    if not any(drop):
        return
    plain = [c for c in caches if type(c) is BatchKVCache]
    for cache in caches:
        if type(cache) is BatchTurboQuantKVCache:
            for row, n in zip(cache.rows, drop, strict=True):
                row.trim(n)
    if not plain:
        return
    least = min(drop)
    extra = [n - least for n in drop]
    pads = plain[0].left_padding.tolist()  # every layer shares one padding and one write index
    for cache in plain:
        if least:
            cache.trim(least)
        _realign(cache, pads, extra)
    end = write_index(plain[0])
    for uid, pad, more in zip(uids, pads, extra, strict=True):
        valid = end - pad - more  # the row's tokens, after the move
        if more:
            order.moved(uid, valid + more, more, min(more, valid))
        else:
            order.trimmed(uid, valid)


def _realign(cache: BatchKVCache, pads: list[int], extra: list[int]) -> None:
    """Rows with `extra[i]` dropped slots at the end: fill them with the row's oldest slots
    (`pads`: each row's left padding before the move)."""
    if not any(extra):
        return
    end = write_index(cache)
    for i, garbage in enumerate(extra):
        if not garbage:
            continue
        valid = end - pads[i] - garbage
        move = min(garbage, valid)
        if move:
            src = slice(pads[i], pads[i] + move)
            dst = slice(end - move, end)
            cache.keys[i : i + 1, :, dst, :] = cache.keys[i : i + 1, :, src, :]
            cache.values[i : i + 1, :, dst, :] = cache.values[i : i + 1, :, src, :]
    shift = mx.array(extra)
    cache.left_padding = cache.left_padding + shift
    cache.offset = cache.offset - shift
