"""The self-check a fused-kernel backend passes before it is used: its kernels against this
package's pure-MLX twin (codec.py, decode_attention.py) on random data, remembered per
device and kernel build (metal/selfcheck.py).

A GPU backend (metal/backend.py's contracts) is checked kernel by kernel; a backend with
only a fused decode step (the CPU one) is checked step against step. The caches built here
are filled with the twin's own encoder: the check runs while kernel_select.py is still
choosing, and every cache sees no backend until it has chosen.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from metal.selfcheck import passes_once_per_build
from services.core.kv.cache import TurboQuantKVCache
from services.core.kv.codec import TurboQuantCodec
from services.core.kv.decode_attention import decode_attention
from services.core.kv.settings import KVCacheSettings
from services.core.kv.token_buffer import TokenBuffer

# The twin and this check: a change to any of them makes a remembered pass void.
TWIN_SOURCES = tuple(sorted(Path(__file__).parent.glob("*.py")))

# (key bits, QJL, head dim, query rows): the default's keys, the paper's QJL keys with more
# query rows than one thread's tile, and a dim that needs padding. Every distinct shape is one more
# kernel to JIT-compile at startup (about 2 s each under CUDA), so the cases are few.
CODEC_CASES = ((4, False, 128, 3), (3, True, 64, 11), (2, True, 80, 3))
# (key bits, QJL, head dim, batch, KV heads, query heads, queries, compressed tokens, dtype)
DECODE_CASES = (
    (4, False, 128, 1, 2, 6, 1, 300, mx.float32),
    (3, True, 64, 2, 1, 3, 4, 40, mx.float32),
    (2, True, 80, 1, 2, 2, 1, 530, mx.float32),
    (3, True, 64, 1, 3, 9, 1, 700, mx.float16),
)


def _fraction_equal(a: mx.array, b: mx.array) -> float:
    return mx.mean(a == b).item()


def _max_error(a: mx.array, b: mx.array) -> float:
    return mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32))).item()


def codec_kernels_match(backend, seed: int, failures: list[str]) -> bool:
    """pack, key_scores and weighted_values against the codec on random vectors.

    pack computes the rotation in its own summation order (and MLX's CUDA matmuls round
    float32 through TF32), so a coordinate within rounding of a codebook boundary may land
    on the other side: a few codes in a thousand may differ, each by one level, and each
    such vector's residual, hence a share of its QJL sign bits, with it. Norms must agree;
    a correct kernel agrees on all but a few code bytes in a thousand, a wrong bit layout on
    about 1 byte in 256."""
    mx.random.seed(seed)
    for case_index, (bits, qjl, dim, n_queries) in enumerate(CODEC_CASES):
        case = f"K{bits}{'+QJL' if qjl else ''} d{dim}"
        codec = TurboQuantCodec(dim, bits, qjl, seed=seed)
        x = mx.random.normal((1, 2, 37, dim))
        twin = codec.encode(x)
        norm, codes, residual_norm, signs = backend.pack(codec, x)
        # (kernel's, twin's, max error or None, share of bytes that must agree)
        packed = [(norm, twin.norm, 1e-3, 0), (codes, twin.codes, None, 0.98)]
        if qjl:
            packed += [(residual_norm, twin.residual_norm, 2e-2, 0), (signs, twin.qjl_signs, None, 0.8)]
        for got, want, tolerance, agree in packed:
            if got.shape != want.shape or got.dtype != want.dtype:
                failures.append(f"pack {case}: {got.shape} {got.dtype} != {want.shape} {want.dtype}")
            elif tolerance is None and _fraction_equal(got, want) < agree:
                failures.append(f"pack {case}: only {_fraction_equal(got, want):.4f} of the bytes agree")
            elif tolerance is not None and _max_error(got, want) > tolerance * max(1.0, mx.max(want).item()):
                failures.append(f"pack {case}: error {_max_error(got, want)}")
        # relative tolerances: the twin's float32 matmuls may run as TF32 (MLX_ENABLE_TF32)
        q = codec.rotate_queries(mx.random.normal((1, 2, n_queries, dim)))
        expected = codec.key_scores(q, twin)
        error = _max_error(backend.key_scores(codec, q, twin), expected)
        if error > 2e-3 * max(1.0, mx.max(mx.abs(expected)).item()):
            failures.append(f"key_scores {case} L{n_queries}: error {error}")
        w = mx.softmax(mx.random.normal((1, 2, n_queries, 37)), axis=-1)
        expected = (w * twin.norm.astype(mx.float32)[..., None, :]) @ codec.centroid_values(twin)
        error = _max_error(backend.weighted_values(codec, w, twin), expected)
        if error > 2e-3 * max(1.0, mx.max(mx.abs(expected)).item()):
            failures.append(f"weighted_values {case} L{n_queries}: error {error}")
        if hasattr(backend, "decoded_run"):
            # a prefill decodes in the model's dtype: each once, the common one for every case
            dtypes = (mx.float16, mx.bfloat16, mx.float32) if case_index == 0 else (mx.float16,)
            decoded_run_matches(backend, codec, twin, case, dtypes, failures)
    return not failures


def decoded_run_matches(backend, key_codec, keys, case: str, dtypes, failures: list[str]) -> None:
    """decoded_run against the twin's estimated keys and decoded values in each of `dtypes` (a GPU
    prefill decodes into the model's; each is one more kernel to JIT-compile; the values reuse
    the keys' codes under a codec without QJL)."""
    value_codec = TurboQuantCodec(key_codec.dim, key_codec.bits, False, seed=key_codec.bits)
    expected = (key_codec.estimated_keys(keys), value_codec.decode_rotated(keys))
    tolerances = {mx.float16: 1e-2, mx.bfloat16: 2e-2, mx.float32: 2e-3}
    for dtype in dtypes:
        tolerance = tolerances[dtype]
        got = backend.decoded_run(key_codec, value_codec, keys, keys, dtype)
        for name, a, want in zip(("keys", "values"), got, expected, strict=True):
            if a.shape != want.shape or a.dtype != dtype:
                failures.append(f"decoded_run {case} {name}: {a.shape} {a.dtype} != {want.shape} {dtype}")
            elif _max_error(a, want) > tolerance * max(1.0, mx.max(mx.abs(want)).item()):
                failures.append(f"decoded_run {case} {name} {dtype}: error {_max_error(a, want)}")


def filled_cache(settings, keys: mx.array, values: mx.array, compressed: int):
    """A TurboQuantKVCache holding keys/values [B, H, N, D]: sinks, then `compressed` tokens
    encoded by the twin, then the rest in the window. Buffers have spare capacity and the
    sinks are a strided view, as in a live cache."""
    cache = TurboQuantKVCache(settings, layer=0)
    cache._codecs(keys, values)
    s, end = settings.sink_tokens, settings.sink_tokens + compressed
    cache.sink_keys, cache.sink_values = keys[:, :, :s], values[:, :, :s]
    cache.compressed_key_buffer = TokenBuffer.of(cache.key_codec.encode(keys[:, :, s:end]).arrays())
    cache.compressed_value_buffer = TokenBuffer.of(cache.value_codec.encode(values[:, :, s:end]).arrays())
    cache.recent_buffer = TokenBuffer.of((keys[:, :, end:], values[:, :, end:]))
    cache.offset = keys.shape[2]
    return cache


def decode_matches(backend, seed: int, failures: list[str]) -> bool:
    """decode_attention against the twin's decode step (queries at the end of the cache).
    The tolerance covers float32 rounding of two different summation orders over a few
    hundred tokens (and float16 outputs); a wrong mask, block or sign is off by 0.1 or more."""
    mx.random.seed(seed)
    for case in DECODE_CASES:
        bits, qjl, dim, batch, kv_heads, q_heads, n_queries, compressed, dtype = case
        settings = KVCacheSettings(key_bits=bits, value_bits=bits, key_qjl=qjl, seed=seed)
        total = settings.sink_tokens + compressed + 70
        keys = (mx.random.normal((batch, kv_heads, total, dim)) * 2).astype(dtype)
        values = mx.random.normal((batch, kv_heads, total, dim)).astype(dtype)
        cache = filled_cache(settings, keys, values, compressed)
        queries = mx.random.normal((batch, q_heads, n_queries, dim)).astype(dtype)
        scale = dim**-0.5
        got = backend.decode_attention(queries, cache, scale, total - n_queries)
        if got is None or got.dtype != dtype or got.shape != queries.shape:
            failures.append(f"decode {case[:-1]}: {None if got is None else (got.shape, got.dtype)}")
            continue
        error = _max_error(got, decode_attention(queries, cache, scale))
        if error > (2e-2 if dtype == mx.float16 else 5e-3):
            failures.append(f"decode {case[:-1]} {dtype}: error {error}")
    return not failures


# (key bits, QJL, value bits, head dim, queries): the default, every bit width the cache offers, QJL on
# and off, a padded head dim (80 -> 128) with a tail past the 8-lane loop, GQA, one query
# and several (the newest of which sit inside the compressed run).
DECODE_STEP_CASES = (
    (4, False, 3, 128, 2),  # the default
    (3, True, 3, 64, 1),  # the paper's
    (4, False, 2, 80, 3),
    (2, True, 4, 36, 5),
    (1, False, 1, 32, 2),
)


def decode_step_matches(backend, seed: int, failures: list[str]) -> bool:
    """decode_attention against softmax over the twin's own scores and decoded values
    (plain MLX ops: the twin's compiled step would cost a C++ compile here), on caches with
    sinks, a compressed run with spare buffer room (strided heads) and a window, batch 2."""
    mx.random.seed(seed)
    for key_bits, qjl, value_bits, dim, n_queries in DECODE_STEP_CASES:
        settings = KVCacheSettings(
            key_bits=key_bits,
            value_bits=value_bits,
            key_qjl=qjl,
            sink_tokens=4,
            recent_window=4,
            block_size=8,
        )
        cache = TurboQuantKVCache(settings, layer=seed)
        keys, values = mx.random.normal((2, 2, 60, dim)) * 2, mx.random.normal((2, 2, 60, dim))
        cache.update_and_fetch(keys, values)
        queries = mx.random.normal((2, 6, n_queries, dim))
        got = backend.decode_attention(queries, cache, 0.2, cache.offset - n_queries)
        if got is None or not mx.allclose(got, _reference_step(queries, cache, 0.2), rtol=1e-4, atol=1e-5):
            failures.append(
                f"decode step K{key_bits}{'+QJL' if qjl else ''}V{value_bits} d{dim} L{n_queries}"
            )
    return not failures


def _reference_step(queries: mx.array, cache, scale: float) -> mx.array:
    key_codec, value_codec = cache.key_codec, cache.value_codec
    B, n_q_heads, L, D = queries.shape
    rep = n_q_heads // cache.sink_keys.shape[1]
    q = (queries * scale).reshape(B, -1, rep * L, D)
    scores = mx.concatenate(
        [
            q @ cache.sink_keys.swapaxes(-1, -2),
            key_codec.key_scores(key_codec.rotate_queries(q), cache.compressed_keys),
            q @ cache.recent_keys.swapaxes(-1, -2),
        ],
        axis=-1,
    )
    position = mx.tile(cache.offset - L + mx.arange(L), (rep,))[:, None]
    scores = mx.where(mx.arange(cache.offset)[None] <= position, scores, -mx.inf)
    values = [cache.sink_values, value_codec.decode(cache.compressed_values), cache.recent_values]
    out = mx.softmax(scores, axis=-1, precise=True) @ mx.concatenate(values, axis=2)
    return out.reshape(B, n_q_heads, L, D)


def backend_matches_twin(backend, seed: int = 0, failures: list[str] | None = None) -> bool:
    """Every kernel of `backend` reproduces the twin on random data; what disagreed is
    appended to `failures` when given."""
    failures = [] if failures is None else failures
    if hasattr(backend, "pack"):
        codec_kernels_match(backend, seed, failures)
        if hasattr(backend, "decode_attention"):
            decode_matches(backend, seed, failures)
    else:
        decode_step_matches(backend, seed, failures)
    return not failures


def kernels_pass(backend) -> bool:
    """Whether `backend` (a module of metal/ with NAME, present(), sources() and its kernels)
    may serve here: present on this device and matching the twin, checked once per device and
    kernel build (kernel_select.py keeps the choice for the process). Any failure of the
    kernels, even a crash, means no: the twin serves."""
    try:
        if not backend.present():
            return False
        sources = [*backend.sources(), *TWIN_SOURCES]
        return passes_once_per_build(backend.NAME, sources, lambda: backend_matches_twin(backend))
    except Exception:  # noqa: BLE001 - any kernel failure means: use the twin
        return False
