"""The self-check every kernel backend passes before it is used: its kernels against the
pure-MLX twin (services/core/kv/codec.py, decode_attention.py) on random data.

A backend is a module or object with pack / key_scores / weighted_values and optionally
decode_attention (contracts: metal/backend.py). The caches checked here are filled with
the twin's own encoder, never through kernel_backend(): the check runs while
kernel_backend() is still deciding, and must not ask it again.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import mlx.core as mx

# The pure-MLX twin the kernels are checked against, and this check itself: a change to either
# makes a remembered pass void.
_TWIN_SOURCES = (Path(__file__), *sorted(Path(__file__).parents[1].glob("services/core/kv/*.py")))
CACHE_ENV = "MOE_MESH_SELFCHECK_CACHE"  # "0": check in every process

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
    a wrong bit layout agrees on about 1 byte in 256 (the H200 measured 99.8-99.9 % of the
    code bytes)."""
    from services.core.kv.codec import TurboQuantCodec

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
    from services.core.kv.codec import TurboQuantCodec

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
    from services.core.kv.cache import TurboQuantKVCache
    from services.core.kv.token_buffer import TokenBuffer

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
    from services.core.kv.decode_attention import decode_attention
    from services.core.kv.settings import KVCacheSettings

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


def backend_matches_twin(backend, seed: int = 0, failures: list[str] | None = None) -> bool:
    """Every kernel of `backend` reproduces the twin on random data; what disagreed is
    appended to `failures` when given."""
    failures = [] if failures is None else failures
    codec_kernels_match(backend, seed, failures)
    if hasattr(backend, "decode_attention"):
        decode_matches(backend, seed, failures)
    return not failures


def check_key(backend: str, sources: Iterable[Path]) -> str:
    """What a remembered pass is valid for: the backend, this device, MLX's version, and the
    bytes of the kernel sources (and built library) with the twin and the check."""
    digest = hashlib.sha256(f"{backend}|{mx.__version__}|{mx.default_device()}".encode())
    info = mx.device_info()  # only what names the device: other fields (free memory) vary
    digest.update(json.dumps([info.get("device_name"), info.get("architecture")], default=str).encode())
    for path in (*sources, *_TWIN_SOURCES):
        digest.update(path.name.encode())
        digest.update(path.read_bytes() if path.is_file() else b"(absent)")
    return digest.hexdigest()[:32]


def passes_once_per_build(backend: str, sources: Iterable[Path], check: Callable[[], bool]) -> bool:
    """`check()`, remembered per device and kernel build: the first process on a device runs
    it (NVRTC compiles, tens of seconds under CUDA) and leaves a file in
    $MOE_MESH_CACHE/selfcheck/; later ones with the same key skip it. Only a pass is kept, so
    a failure (or a crash in the check) is checked again by the next process."""
    cache_dir = Path(os.environ.get("MOE_MESH_CACHE", Path.home() / ".cache" / "moe-mesh")) / "selfcheck"
    use_cache = os.environ.get(CACHE_ENV, "1") != "0"
    marker = cache_dir / f"{backend}-{check_key(backend, sources)}.passed"
    if use_cache and marker.exists():
        return True
    passed = check()
    if passed and use_cache:
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
            marker.write_text(f"{mx.__version__} {mx.default_device()}\n")
        except OSError:  # a read-only cache only costs the next process its check
            pass
    return passed
