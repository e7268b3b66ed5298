"""Loader of metal/turboquant.metal for mx.fast.metal_kernel, with the same contracts as
the pure-MLX twin in services/core/kv/codec.py.

The kernels only exist on Apple GPUs. `kernels_available()` is False elsewhere, and on a
Mac it is True only after the kernels reproduced the twin on a random self-check (run
once per process): a kernel that disagrees is never used, the twin is.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import mlx.core as mx

SOURCE = Path(__file__).with_name("turboquant.metal")


def _sections() -> dict[str, str]:
    sections, name, lines = {}, None, []
    for line in SOURCE.read_text().splitlines():
        if line.startswith("//// "):
            if name:
                sections[name] = "\n".join(lines)
            name, lines = line[5:].strip(), []
        elif name:
            lines.append(line)
    sections[name] = "\n".join(lines)
    return sections


def metal_present() -> bool:
    return mx.metal.is_available()


@cache
def _kernel(name: str):
    parts = _sections()
    inputs = {
        "pack": ["x", "rotation", "boundaries", "centroids", "qjl_t"],
        "scores": [
            "queries",
            "projected",
            "codes",
            "norm",
            "residual_norm",
            "signs",
            "centroids",
            "qjl_scale",
        ],
        "values": ["weights", "codes", "norm", "centroids"],
    }[name]
    outputs = {
        "pack": ["norm", "codes", "residual_norm", "signs"],
        "scores": ["scores"],
        "values": ["out"],
    }[name]
    return mx.fast.metal_kernel(
        name=f"turboquant_{name}",
        input_names=inputs,
        output_names=outputs,
        source=parts[name],
        header=parts["header"],
    )


def pack(codec, x: mx.array):
    """x [..., D] -> (norm, codes, residual_norm, signs) as codec.encode stores them."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, codec.dim).astype(mx.float32)
    n, p = flat.shape[0], codec.padded
    code_bytes = _code_bytes(codec)
    qjl_t = codec.qjl_matrix_t if codec.qjl else mx.zeros((1,), mx.float32)
    norm, codes, residual_norm, signs = _kernel("pack")(
        inputs=[flat, codec.rotation.matrix, codec.boundaries, codec.centroids, qjl_t],
        template=[
            ("P", p),
            ("D", codec.dim),
            ("BITS", codec.bits),
            ("QJL", int(codec.qjl)),
            ("CODE_BYTES", code_bytes),
        ],
        grid=(n * p, 1, 1),
        threadgroup=(p, 1, 1),
        output_shapes=[(n,), (n, code_bytes), (n,), (n, p // 8)],
        output_dtypes=[mx.float16, mx.uint8, mx.float16, mx.uint8],
    )
    return (
        norm.reshape(lead),
        codes.reshape(*lead, code_bytes),
        residual_norm.reshape(lead) if codec.qjl else None,
        signs.reshape(*lead, p // 8) if codec.qjl else None,
    )


def key_scores(codec, rotated_queries: mx.array, tokens) -> mx.array:
    """Same contract as TurboQuantCodec.key_scores: [B, H, L, P] x tokens -> [B, H, L, T]."""
    B, H, L, p = rotated_queries.shape
    T = tokens.length
    q = rotated_queries.reshape(B * H, L, p).astype(mx.float32)
    projected = q @ codec.qjl_matrix_t if codec.qjl else q
    empty_half = mx.zeros((B * H, T), mx.float16)
    (scores,) = _kernel("scores")(
        inputs=[
            q,
            projected,
            tokens.codes.reshape(B * H, T, -1),
            tokens.norm.reshape(B * H, T),
            tokens.residual_norm.reshape(B * H, T) if codec.qjl else empty_half,
            tokens.qjl_signs.reshape(B * H, T, -1) if codec.qjl else mx.zeros((1,), mx.uint8),
            codec.centroids,
            mx.array([codec.qjl_scale if codec.qjl else 0.0], mx.float32),
        ],
        template=[
            ("P", p),
            ("BITS", codec.bits),
            ("QJL", int(codec.qjl)),
            ("CODE_BYTES", _code_bytes(codec)),
        ],
        grid=(T, L, B * H),
        threadgroup=(min(T, 256), 1, 1),
        output_shapes=[(B * H, L, T)],
        output_dtypes=[mx.float32],
    )
    return scores.reshape(B, H, L, T)


def weighted_values(codec, weights: mx.array, tokens) -> mx.array:
    """sum_t weights[..., t] * |v_t| * centroids(v_t), rotated: [B, H, L, T] -> [B, H, L, P]."""
    B, H, L, T = weights.shape
    p = codec.padded
    (out,) = _kernel("values")(
        inputs=[
            weights.reshape(B * H, L, T).astype(mx.float32),
            tokens.codes.reshape(B * H, T, -1),
            tokens.norm.reshape(B * H, T),
            codec.centroids,
        ],
        template=[("P", p), ("BITS", codec.bits), ("CODE_BYTES", _code_bytes(codec))],
        grid=(p, L, B * H),
        threadgroup=(p, 1, 1),
        output_shapes=[(B * H, L, p)],
        output_dtypes=[mx.float32],
    )
    return out.reshape(B, H, L, p)


def _code_bytes(codec) -> int:
    from services.core.kv.packing import packed_bytes

    return packed_bytes(codec.bits, codec.padded)


def kernels_match_twin(seed: int = 0) -> bool:
    """Run every kernel on random data and compare with the pure-MLX twin."""
    from services.core.kv.codec import TurboQuantCodec
    from services.core.kv.compressed import CompressedTokens

    mx.random.seed(seed)
    for bits, qjl, dim in ((3, True, 128), (4, False, 64), (2, True, 80)):
        codec = TurboQuantCodec(dim, bits, qjl, seed=seed)
        x = mx.random.normal((1, 2, 37, dim))
        twin = codec.encode(x)
        norm, codes, residual_norm, signs = pack(codec, x)
        packed = CompressedTokens(norm, codes, residual_norm, signs)
        if not mx.allclose(codec.decode(packed), codec.decode(twin), atol=1e-2).item():
            return False
        q = codec.rotate_queries(mx.random.normal((1, 2, 3, dim)))
        if not mx.allclose(key_scores(codec, q, twin), codec.key_scores(q, twin), atol=1e-3).item():
            return False
        w = mx.softmax(mx.random.normal((1, 2, 3, 37)), axis=-1)
        expected = (w * twin.norm.astype(mx.float32)[..., None, :]) @ codec.centroid_values(twin)
        if not mx.allclose(weighted_values(codec, w, twin), expected, atol=1e-4).item():
            return False
    return True


@cache
def kernels_available() -> bool:
    """True on an Apple GPU whose kernels match the twin on a random self-check."""
    if not metal_present():
        return False
    try:
        return kernels_match_twin()
    except Exception:  # noqa: BLE001 - any kernel failure means: use the twin
        return False
