"""TurboQuant's decode step for CPUs (metal/turboquant_cpu.c through ctypes), a kernel
backend that offers `decode_attention` only: the whole step in one call. Where it does not
fit (padded head dims past 1024) it returns None and the pure-MLX twin serves the step.

Used where MLX computes on the CPU and the compiled extension is present (setup.py builds
it at install; without a C compiler it is skipped and the twin serves), and only after it
reproduced the twin on a random self-check. The kernels read MLX's memory in place
(NumPy views through the buffer protocol, strides and all), so a call costs one
evaluation of its inputs and one copy of its small result back into MLX.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import mlx.core as mx
import numpy as np

from metal import load_extension

_F32 = ctypes.POINTER(ctypes.c_float)
_U8 = ctypes.POINTER(ctypes.c_uint8)
_U16 = ctypes.POINTER(ctypes.c_uint16)
_I32 = ctypes.POINTER(ctypes.c_int)
_I, _L = ctypes.c_int, ctypes.c_long


# It runs C on host memory, so it evaluates its inputs inside the model's forward pass: core
# first lands any layer call still in flight (services/core/kv/metal_attention.py).
EVALUATES_INPUTS = True


@cache
def _library():
    lib = load_extension("_turboquant_cpu")
    if lib is None:
        return None
    lib.tq_cpu_attention.argtypes = [_I, _I, _I, _I, _F32, _F32, _F32, _I32]  # G, L, D, P, q, qr, sq, pos
    lib.tq_cpu_attention.argtypes += [_I, _F32, _F32, _L]  # sinks
    lib.tq_cpu_attention.argtypes += [_I, _I, _U8, _L, _I, _U16, _L, _U16, _L, _U8, _L, _F32, _F32]  # keys
    lib.tq_cpu_attention.argtypes += [_I, _U8, _L, _I, _U16, _L, _F32]  # compressed values
    lib.tq_cpu_attention.argtypes += [_I, _F32, _F32, _L, _F32, _F32, _F32]  # window, scratch, outputs
    lib.tq_cpu_attention.restype = ctypes.c_int
    return lib


def _view(a: mx.array) -> np.ndarray:
    return np.array(a, copy=False)  # MLX's buffer, no copy (it is evaluated by the caller)


def _pointer(a: np.ndarray | None, kind):
    return None if a is None else a.ctypes.data_as(kind)


def _per_head(a: mx.array | None, row_items: int):
    """(view, stride between heads in elements) of [B, H, T, ...] token data whose rows are
    contiguous, as the cache's token buffers (and views of them) are; B and H may be
    flattened because a buffer's batch stride is H head strides."""
    if a is None:
        return None, 0
    view = _view(a)
    item = view.itemsize
    rows_ok = view.strides[2] == row_items * item and (view.ndim == 3 or view.strides[3] == item)
    if not rows_ok or view.strides[0] != view.shape[1] * view.strides[1]:
        view = np.ascontiguousarray(view)
    return view, view.strides[1] // item


def _contiguous(a: mx.array) -> np.ndarray:
    return np.ascontiguousarray(_view(a), dtype=np.float32)


_MAX_PADDED_DIM = 1024  # TQ_MAX_P in the C source


def _supported(p: int) -> bool:
    return p % 8 == 0 and p <= _MAX_PADDED_DIM


def _check(status: int, p: int) -> None:
    if status != 0:  # unreachable after _supported(); a C-side guard, surfaced loudly
        raise RuntimeError(f"TurboQuant CPU kernel refused padded head dim {p}")


def _exact_run(keys: mx.array | None, values: mx.array | None, dim: int):
    """(length, keys view, values view, head stride) of an exact run, float32."""
    if keys is None or keys.shape[2] == 0:
        return 0, None, None, 0
    if keys.dtype != mx.float32:
        keys, values = keys.astype(mx.float32), values.astype(mx.float32)
        mx.eval(keys, values)
    k, stride = _per_head(keys, dim)
    v, v_stride = _per_head(values, dim)
    if v_stride != stride:
        k, v = np.ascontiguousarray(k), np.ascontiguousarray(v)
        stride = k.strides[1] // k.itemsize
    return keys.shape[2], k, v, stride


def decode_attention(queries: mx.array, cache, scale: float, start: int) -> mx.array | None:
    """softmax(q k^T * scale + causal) v over everything `cache` holds, in one kernel call:
    queries [B, Hq, L, D] after RoPE at positions start.. (rows past the cache's end see
    every key). None when the head dim does not fit the kernel (the caller falls back)."""
    key_codec, value_codec = cache.key_codec, cache.value_codec
    p = key_codec.padded
    if not _supported(p) or value_codec.padded != p:
        return None
    B, n_q_heads, L, D = queries.shape
    keys, values = cache.compressed_keys, cache.compressed_values
    n_kv_heads = keys.norm.shape[1]
    rows = n_q_heads // n_kv_heads * L
    q = (queries.astype(mx.float32) * scale).reshape(B, n_kv_heads, rows, D)
    rotated = key_codec.rotate_queries(q)
    projected = rotated @ key_codec.qjl_matrix_t if key_codec.qjl else None
    mx.eval(q, rotated, *(a for a in (projected, *keys.arrays(), *values.arrays()) if a is not None))
    S, sink_k, sink_v, sink_stride = _exact_run(cache.sink_keys, cache.sink_values, D)
    R, recent_k, recent_v, recent_stride = _exact_run(cache.recent_keys, cache.recent_values, D)
    C = keys.length
    key_bytes, value_bytes = keys.codes.shape[-1], values.codes.shape[-1]
    key_codes, key_codes_stride = _per_head(keys.codes, key_bytes)
    key_norm, key_norm_stride = _per_head(keys.norm, 1)
    residual, residual_stride = _per_head(keys.residual_norm if key_codec.qjl else None, 1)
    signs, signs_stride = _per_head(keys.qjl_signs if key_codec.qjl else None, p // 8)
    value_codes, value_codes_stride = _per_head(values.codes, value_bytes)
    value_norm, value_norm_stride = _per_head(values.norm, 1)
    # row r * L + i of a head is query i of its r-th query head
    positions = np.tile(np.arange(start, start + L, dtype=np.int32), rows // L)
    positions = np.where(positions >= cache.offset, np.int32(2**31 - 1), positions).astype(np.int32)
    G = B * n_kv_heads
    q_np, rotated_np = _contiguous(q), _contiguous(rotated)
    projected_np = None if projected is None else _contiguous(projected)
    scratch = np.empty(rows * (S + C + R), np.float32)
    out_exact = np.empty((G, rows, D), np.float32)
    out_rotated = np.empty((G, rows, p), np.float32)
    u16 = lambda a: None if a is None else a.view(np.uint16)  # noqa: E731
    _check(
        _library().tq_cpu_attention(
            G, rows, D, p, _pointer(q_np, _F32), _pointer(rotated_np, _F32), _pointer(projected_np, _F32),
            _pointer(positions, _I32),
            S, _pointer(sink_k, _F32), _pointer(sink_v, _F32), sink_stride,
            C, key_codec.bits, _pointer(key_codes, _U8), key_codes_stride, key_bytes,
            _pointer(u16(key_norm), _U16), key_norm_stride, _pointer(u16(residual), _U16), residual_stride,
            _pointer(signs, _U8), signs_stride,
            _pointer(_table(key_codec.centroid_table), _F32),
            _pointer(_table(key_codec.sign_table) if key_codec.qjl else None, _F32),
            value_codec.bits, _pointer(value_codes, _U8), value_codes_stride, value_bytes,
            _pointer(u16(value_norm), _U16), value_norm_stride, _pointer(_table(value_codec.centroid_table), _F32),
            R, _pointer(recent_k, _F32), _pointer(recent_v, _F32), recent_stride,
            _pointer(scratch, _F32), _pointer(out_exact, _F32), _pointer(out_rotated, _F32),
        ),
        p,
    )  # fmt: skip
    compressed = value_codec.unrotate(mx.array(out_rotated))
    out = mx.array(out_exact) + compressed
    return out.reshape(B, n_q_heads, L, D).astype(queries.dtype)


_TABLES: dict[int, tuple[mx.array, np.ndarray]] = {}


def _table(table: mx.array) -> np.ndarray:
    """A codec's lookup table as float32 NumPy, made once per table (codecs are shared
    and few; the entry keeps its array alive so the id cannot be reused)."""
    entry = _TABLES.get(id(table))
    if entry is None:
        entry = _TABLES[id(table)] = (table, _contiguous(table))
    return entry[1]


NAME = "cpu"


def present() -> bool:
    """Where MLX computes on the CPU and the extension is built."""
    return mx.default_device() == mx.cpu and _library() is not None


def sources() -> list[Path]:
    """What a remembered self-check pass is valid for: the built library's own bytes too."""
    return [Path(_library()._name), Path(__file__).with_name("turboquant_cpu.c"), Path(__file__)]
