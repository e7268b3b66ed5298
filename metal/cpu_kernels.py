"""TurboQuant decode kernels for CPUs (metal/turboquant_cpu.c through ctypes), a kernel
backend with the contracts of metal/kernels.py: `key_scores` and `weighted_values`.

Used where MLX computes on the CPU and the compiled extension is present (setup.py builds
it at install; without a C compiler it is skipped and the twin serves), and only after it
reproduced the twin on a random self-check. The kernels read MLX's memory in place
(NumPy views through the buffer protocol, strides and all), so a call costs one
evaluation of its inputs and one copy of its small result back into MLX.
"""

from __future__ import annotations

import ctypes
import importlib.util
from functools import cache

import mlx.core as mx
import numpy as np

_F32 = ctypes.POINTER(ctypes.c_float)
_U8 = ctypes.POINTER(ctypes.c_uint8)
_U16 = ctypes.POINTER(ctypes.c_uint16)
_I, _L = ctypes.c_int, ctypes.c_long


@cache
def _library():
    spec = importlib.util.find_spec("metal._turboquant_cpu")
    if spec is None or not spec.origin:
        return None
    lib = ctypes.CDLL(spec.origin)
    lib.tq_cpu_scores.argtypes = [_I, _I, _I, _I, _I, _F32, _F32, _U8, _L, _I, _U16, _L, _U16, _L, _U8, _L]
    lib.tq_cpu_scores.argtypes += [_F32, _F32, _F32]
    lib.tq_cpu_values.argtypes = [_I, _I, _I, _I, _I, _F32, _U8, _L, _I, _U16, _L, _F32, _F32]
    lib.tq_cpu_scores.restype = lib.tq_cpu_values.restype = ctypes.c_int
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


def key_scores(codec, rotated_queries: mx.array, tokens) -> mx.array:
    """Same contract as TurboQuantCodec.key_scores: [B, H, L, P] x tokens -> [B, H, L, T]."""
    B, H, L, p = rotated_queries.shape
    if not _supported(p):
        return codec.key_scores(rotated_queries, tokens)
    T = tokens.length
    q = rotated_queries.astype(mx.float32)
    projected = q @ codec.qjl_matrix_t if codec.qjl else None
    mx.eval(q, *(a for a in (projected, *tokens.arrays()) if a is not None))
    code_bytes = tokens.codes.shape[-1]
    codes, codes_stride = _per_head(tokens.codes, code_bytes)
    norm, norm_stride = _per_head(tokens.norm, 1)
    residual, residual_stride = _per_head(tokens.residual_norm if codec.qjl else None, 1)
    signs, signs_stride = _per_head(tokens.qjl_signs if codec.qjl else None, p // 8)
    q_np, sq_np = _contiguous(q), None if projected is None else _contiguous(projected)
    centroid_table = _contiguous(codec.centroid_table)
    sign_table = _contiguous(codec.sign_table) if codec.qjl else None
    out = np.empty((B * H, L, T), np.float32)
    _check(
        _library().tq_cpu_scores(
            B * H, L, T, p, codec.bits,
            _pointer(q_np, _F32), _pointer(sq_np, _F32),
            _pointer(codes, _U8), codes_stride, code_bytes,
            _pointer(norm.view(np.uint16), _U16), norm_stride,
            _pointer(None if residual is None else residual.view(np.uint16), _U16), residual_stride,
            _pointer(signs, _U8), signs_stride,
            _pointer(centroid_table, _F32), _pointer(sign_table, _F32), _pointer(out, _F32),
        ),
        p,
    )  # fmt: skip
    return mx.array(out).reshape(B, H, L, T)


def weighted_values(codec, weights: mx.array, tokens) -> mx.array:
    """sum_t weights[..., t] * |v_t| * centroids(v_t), rotated: [B, H, L, T] -> [B, H, L, P]."""
    B, H, L, T = weights.shape
    p = codec.padded
    if not _supported(p):
        return (weights * tokens.norm.astype(mx.float32)[..., None, :]) @ codec.centroid_values(tokens)
    w = weights.astype(mx.float32)
    mx.eval(w, tokens.codes, tokens.norm)
    code_bytes = tokens.codes.shape[-1]
    codes, codes_stride = _per_head(tokens.codes, code_bytes)
    norm, norm_stride = _per_head(tokens.norm, 1)
    w_np = _contiguous(w)
    table = _contiguous(codec.centroid_table)
    out = np.empty((B * H, L, p), np.float32)
    _check(
        _library().tq_cpu_values(
            B * H, L, T, p, codec.bits, _pointer(w_np, _F32),
            _pointer(codes, _U8), codes_stride, code_bytes,
            _pointer(norm.view(np.uint16), _U16), norm_stride,
            _pointer(table, _F32), _pointer(out, _F32),
        ),
        p,
    )  # fmt: skip
    return mx.array(out).reshape(B, H, L, p)


def kernels_match_twin(seed: int = 0) -> bool:
    """Both kernels against the pure-MLX twin on random data, for the bit widths the cache
    offers, a padded head dim, and token views with spare buffer room (strided heads)."""
    from services.core.kv.codec import TurboQuantCodec

    mx.random.seed(seed)
    for bits, qjl, dim in ((3, True, 128), (4, False, 64), (2, True, 80), (1, False, 32)):
        codec = TurboQuantCodec(dim, bits, qjl, seed=seed)
        tokens = codec.encode(mx.random.normal((2, 3, 41, dim))).tokens(0, 37)
        q = codec.rotate_queries(mx.random.normal((2, 3, 4, dim)))
        if not mx.allclose(key_scores(codec, q, tokens), codec.key_scores(q, tokens), rtol=1e-4, atol=1e-4):
            return False
        w = mx.softmax(mx.random.normal((2, 3, 4, 37)), axis=-1)
        expected = (w * tokens.norm.astype(mx.float32)[..., None, :]) @ codec.centroid_values(tokens)
        if not mx.allclose(weighted_values(codec, w, tokens), expected, rtol=1e-4, atol=1e-5):
            return False
    return True


@cache
def kernels_available() -> bool:
    """True where MLX computes on the CPU, the extension is built and it matches the twin."""
    if mx.default_device() != mx.cpu or _library() is None:
        return False
    try:
        return kernels_match_twin()
    except Exception:  # noqa: BLE001 - any kernel failure means: use the twin
        return False
