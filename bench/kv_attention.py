"""One attention layer's decode step over a TurboQuant vs an fp16 cache, at long context.

    python bench/kv_attention.py                       # 1K/4K/16K, head_dim 64 and 128
    python bench/kv_attention.py --contexts 4096 --head-dims 128
    python bench/kv_attention.py --prefill-chunk 256    # also: store + attend a prompt chunk

Isolates what the KV cache costs per decode step (the whole-model bench/kv.py needs a
16K-token prefill, which takes hours on a small CPU). Cache: random keys/values
stored through TurboQuantKVCache's own update path (default settings); fp16: mlx-lm's
fused scaled_dot_product_attention over the same keys in float16 (float32 on CPUs,
where MLX has no fast float16 path). Best of `--repeats`; prints one JSON object.

With `--decode-steps N`, each row also runs N whole decode steps of `--layers` caches (one
new token stored and attended per layer, one evaluation per step, as a model's decode step
runs) and splits the time per layer call: building the graph on the host (Python and MLX op
construction) and the whole step (that, the device's work and the wait for it), for the
step, the token's append alone and the attention alone. On a GPU these fixed costs per op
are what a small model's step cannot hide.

With `--prefill-chunk N`, each row also times one prefill chunk of N new tokens at that
context: stored (fp16: mlx-lm's KVCache, in place; TurboQuant: its own update, which
compresses what ages) and attended causally. With `--prefill-paths` too, the chunk's
attention alone (the cache already updated) is also timed on each TurboQuant prefill path:
the decoded run under one fused call (taken while the copy fits the budget) and block by
block (taken past it), with their largest difference from the fused one.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kv import kernel_backend_name
from bench.timing import step_split_us
from services.core.kv import KVCacheSettings, TurboQuantKVCache, prefill_attention, turboquant_attention
from services.core.kv.kernel_select import kernel_backend
from services.core.kv.prefill_attention import blockwise_attention, prefill_dtype


def best_ms(fn, repeats: int, inner: int = 10) -> float:
    mx.eval(fn())
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            mx.eval(fn())
        best = min(best, (time.perf_counter() - start) / inner)
    return best * 1e3


def prefill_row(cache, keys, values, args, dtype, scale) -> dict:
    chunk = args.prefill_chunk
    dim = keys.shape[-1]
    new_k, new_v, queries = (
        mx.random.normal((1, h, chunk, dim)).astype(dtype)
        for h in (args.kv_heads, args.kv_heads, args.q_heads)
    )
    plain = KVCache()
    plain.update_and_fetch(keys, values)
    mx.eval(plain.state)

    def fp16_chunk():
        k, v = plain.update_and_fetch(new_k, new_v)
        mx.eval(mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask="causal"))
        plain.trim(chunk)

    def turboquant_chunk():
        twin = copy.copy(cache)  # shares the stored arrays; the update builds new ones
        twin.update_and_fetch(new_k, new_v)
        mx.eval(turboquant_attention(queries, twin, scale), twin.state)

    times = {}
    for _ in range(max(1, args.repeats // 2)):
        for name, fn in (("fp16", fp16_chunk), ("turboquant", turboquant_chunk)):
            start = time.perf_counter()
            fn()
            times[name] = min(times.get(name, float("inf")), time.perf_counter() - start)
    row = {
        "prefill_fp16_ms": round(times["fp16"] * 1e3, 2),
        "prefill_turboquant_ms": round(times["turboquant"] * 1e3, 2),
        "prefill_speed_ratio": round(times["fp16"] / times["turboquant"], 3),
    }
    if args.prefill_paths:
        row.update(prefill_paths(cache, new_k, new_v, queries, plain, args, scale))
    return row


def prefill_paths(cache, new_k, new_v, queries, plain, args, scale) -> dict:
    """Attention only, for a chunk already stored: fp16's fused call, and TurboQuant's fused
    path (the run decoded for the call) and block-by-block path (prefill_attention)."""
    stored = copy.copy(cache)
    stored.update_and_fetch(new_k, new_v)
    keys, values = plain.update_and_fetch(new_k, new_v)
    mx.eval(stored.state, keys, values)
    start = stored.offset - queries.shape[2]
    fused = lambda: turboquant_attention(queries, stored, scale)  # noqa: E731 (within the budget)
    blockwise = lambda: blockwise_attention(queries, stored, scale, start, dtype=prefill_dtype(queries))  # noqa: E731
    assert prefill_attention.decoded_run_fits(stored, prefill_dtype(queries)), (
        "fused would take the block path"
    )
    ms = {
        "fp16": best_ms(
            lambda: mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask="causal"),
            args.repeats,
            inner=3,
        ),
        "fused": best_ms(fused, args.repeats, inner=3),
        "blockwise": best_ms(blockwise, args.repeats, inner=3),
    }
    difference = mx.abs(blockwise().astype(mx.float32) - fused().astype(mx.float32)).max().item()
    plain.trim(queries.shape[2])
    row = {
        "attend_fp16_ms": round(ms["fp16"], 3),
        "attend_fused_ms": round(ms["fused"], 3),
        "attend_blockwise_ms": round(ms["blockwise"], 3),
        "attend_fused_ratio": round(ms["fp16"] / ms["fused"], 3),
        "attend_blockwise_ratio": round(ms["fp16"] / ms["blockwise"], 3),
        "blockwise_max_abs_difference": round(difference, 6),
    }
    return row | decode_run_ms(stored, prefill_dtype(queries), args.repeats)


def decode_run_ms(cache, dtype, repeats: int) -> dict:
    """The compressed run's decode for one prefill call alone: the backend's kernel (where the
    device has one) against the twin's array ops, and how far apart their numbers are."""
    kc, vc = cache.key_codec, cache.value_codec
    keys, values = cache.compressed_keys, cache.compressed_values
    twin = lambda: (kc.estimated_keys(keys, dtype), vc.decode_rotated(values).astype(dtype))  # noqa: E731
    row = {"decode_run_twin_ms": round(best_ms(twin, repeats, inner=3), 3)}
    fused = getattr(kernel_backend(), "decoded_run", None)
    if fused is not None:
        kernel = lambda: fused(kc, vc, keys, values, dtype)  # noqa: E731
        row["decode_run_kernel_ms"] = round(best_ms(kernel, repeats, inner=3), 3)
        row["decode_run_max_abs_difference"] = max(
            mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()
            for a, b in zip(kernel(), twin(), strict=True)
        )
    return row


def decode_breakdown(keys, values, args, dtype, scale) -> dict:
    """Per layer call of `args.decode_steps` decode steps over `args.layers` caches of each kind,
    filled with the same tokens, one evaluation per step of what it computes: median host µs (graph building) and
    step µs (build, run, wait) of the whole step (append the token, attend), of the append alone
    and of the attention alone (over the cache as it is)."""
    _, n_kv, _, dim = keys.shape
    mx.random.seed(1)
    steps = args.decode_steps
    new_k = mx.random.normal((steps, 1, n_kv, 1, dim)).astype(dtype)
    new_v = mx.random.normal((steps, 1, n_kv, 1, dim)).astype(dtype)
    query = mx.random.normal((steps, 1, args.q_heads, 1, dim)).astype(dtype)
    mx.eval(new_k, new_v, query)

    def fp16_cache():
        cache = KVCache()
        cache.update_and_fetch(keys, values)
        return cache

    def turboquant_cache():
        cache = TurboQuantKVCache(KVCacheSettings(), layer=0)
        for i in range(0, keys.shape[2], 2048):
            cache.update_and_fetch(keys[:, :, i : i + 2048], values[:, :, i : i + 2048])
            mx.eval(cache.state)
        return cache

    def fp16_append(cache, i):  # the whole buffers it wrote (slicing views would add ops of their own)
        cache.update_and_fetch(new_k[i], new_v[i])
        return [cache.keys, cache.values]

    def fp16_attend(cache, i):
        k, v = cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]
        return mx.fast.scaled_dot_product_attention(query[i], k, v, scale=scale, mask=None)

    def fp16_step(cache, i):
        k, v = cache.update_and_fetch(new_k[i], new_v[i])
        return mx.fast.scaled_dot_product_attention(query[i], k, v, scale=scale, mask=None)

    def turboquant_append(cache, i):
        cache.update_and_fetch(new_k[i], new_v[i])
        buffers = (cache.recent_buffer, cache.compressed_key_buffer, cache.compressed_value_buffer)
        return [a for b in buffers if b is not None for a in b.arrays]

    def turboquant_attend(cache, i):
        return turboquant_attention(query[i], cache, scale)

    def turboquant_step(cache, i):
        cache.update_and_fetch(new_k[i], new_v[i])
        return turboquant_attention(query[i], cache, scale)

    row = {}
    for name, make, parts in (
        ("fp16", fp16_cache, {"step": fp16_step, "append": fp16_append, "attend": fp16_attend}),
        (
            "turboquant",
            turboquant_cache,
            {"step": turboquant_step, "append": turboquant_append, "attend": turboquant_attend},
        ),
    ):
        caches = [make() for _ in range(args.layers)]
        mx.eval([c.state for c in caches])
        for part, call in parts.items():
            # evaluated as a decode step is: what it computes, not views of the caches
            host, step = step_split_us(
                lambda i, call=call, caches=caches: [call(c, i) for c in caches], steps, args.layers
            )
            row[f"decode_{name}_{part}_host_us"], row[f"decode_{name}_{part}_us"] = host, step
        del caches
    row["decode_step_ratio"] = round(row["decode_fp16_step_us"] / row["decode_turboquant_step_us"], 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--q-heads", type=int, default=9)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prefill-chunk", type=int, default=0, help="also time a prefill chunk (0: no)")
    parser.add_argument(
        "--prefill-paths", action="store_true", help="with --prefill-chunk: also time each prefill path"
    )
    parser.add_argument(
        "--decode-steps", type=int, default=0, help="also split whole decode steps' time (0: no)"
    )
    parser.add_argument("--layers", type=int, default=30, help="caches per decode step (--decode-steps)")
    args = parser.parse_args()
    dtype = mx.float32 if mx.default_device() == mx.cpu else mx.float16
    settings = KVCacheSettings()
    result = {
        "bench": "kv_attention",
        "device": str(mx.default_device()),
        "settings": settings.describe(),
        "kernels": kernel_backend_name(),
    }
    rows = {}
    for dim in args.head_dims:
        for n in args.contexts:
            mx.random.seed(0)
            keys = mx.random.normal((1, args.kv_heads, n, dim)).astype(dtype)
            values = mx.random.normal((1, args.kv_heads, n, dim)).astype(dtype)
            cache = TurboQuantKVCache(settings, layer=0)
            for i in range(0, n, 2048):
                cache.update_and_fetch(keys[:, :, i : i + 2048], values[:, :, i : i + 2048])
                mx.eval(cache.state)
            query = mx.random.normal((1, args.q_heads, 1, dim)).astype(dtype)
            scale = dim**-0.5
            fp16 = best_ms(
                lambda q=query, k=keys, v=values, s=scale: mx.fast.scaled_dot_product_attention(
                    q, k, v, scale=s, mask=None
                ),
                args.repeats,
            )
            tq = best_ms(lambda q=query, c=cache, s=scale: turboquant_attention(q, c, s), args.repeats)
            rows[f"d{dim}/{n}"] = {
                "fp16_ms": round(fp16, 3),
                "turboquant_ms": round(tq, 3),
                "speed_ratio": round(fp16 / tq, 3),
                "bytes_ratio_vs_fp16": round(2 * keys.size * 2 / cache.nbytes, 2),  # K and V, 2 bytes each
            }
            if args.decode_steps:
                rows[f"d{dim}/{n}"].update(decode_breakdown(keys, values, args, dtype, scale))
            if args.prefill_chunk:
                rows[f"d{dim}/{n}"].update(prefill_row(cache, keys, values, args, dtype, scale))
            print(json.dumps({"progress": f"d{dim}/{n}", **rows[f"d{dim}/{n}"]}), file=sys.stderr, flush=True)
    result["rows"] = rows
    print(json.dumps(result))


if __name__ == "__main__":
    main()
