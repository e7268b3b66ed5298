"""TurboQuant vs fp16 KV cache: prefill and decode tok/s at long context, KV bytes/token.

    python bench/kv.py                                  # demo model's dense twin, 1K/4K/16K
    python bench/kv.py --contexts 512 1024 --decode-tokens 8 --rounds 1
    python bench/kv.py --model PATH --dtype float16     # any mlx-lm checkpoint
    python bench/kv.py --dequantize                     # on a CPU (see below)
    python bench/kv.py --dequantize --random-fill       # decode only, caches filled at random
    python bench/kv.py --dense-kernel                   # on a CPU, projections as core computes them
    python bench/kv.py --kv-key-bits 3 --kv-qjl         # the paper's K3+QJL keys (core's flags)

Monolithic mlx-lm (the model's own attention code, TurboQuant reached through
install_turboquant_attention). For each context: the prompt (the bundled GPL-3 text,
repeated) but its last token is prefilled in chunks the way mlx-lm's generate_step does
it (only the cache is evaluated, not the logits of every prompt position), then
`--decode-tokens` greedy tokens are generated one at a time, starting from the last
prompt token. Kinds run interleaved, best of `--rounds`; ratios are TurboQuant / fp16
from the same run. Prints one JSON object.

`--dequantize` turns the 4-bit weights into float32 first: MLX's CPU quantized matmul is
orders of magnitude slower than its float32 one (a 256-token prefill of the demo model
takes ~35 s quantized on a 2-core x86), while the KV cache and attention, all this bench
compares, do not depend on how the projections are stored. `--dense-kernel` keeps the 4-bit
weights and computes them with core's CPU kernel (metal/linear_cpu.py), as `moe-mesh core` does on a
CPU: ~10x faster projections, so attention is a larger share of each step and the
ratios are the ones a CPU core sees.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.core.kv import (
    KVCacheSettings,
    TurboQuantKVCache,
    kv_cache_bytes,
    make_kv_cache,
    turboquant_attention,
)
from services.core.kv.cli_flags import add_kv_cache_flags, kv_settings_from_args
from services.tools.kv_quality import load_bench_model

TEXT = Path(__file__).resolve().parents[1] / "tests" / "assets" / "gpl-3.0.txt"


def prompt_tokens(tokenizer, n: int) -> list[int]:
    ids = tokenizer.encode(TEXT.read_text())
    return (ids * (n // len(ids) + 1))[:n]


def twin_error() -> float:
    """Max |TurboQuant attention - attention over the decoded cache| on this device, for a
    decode step, a few queries and a prefill chunk: the speed below is only worth
    reporting if the fast paths compute the same numbers here (no QJL, so the decoded
    cache is the exact oracle)."""
    settings = KVCacheSettings(key_qjl=False, sink_tokens=4, recent_window=64, block_size=16)
    mx.random.seed(0)
    worst = 0.0
    for n_queries in (1, 5, 40):
        cache = TurboQuantKVCache(settings, layer=0)
        keys, values = mx.random.normal((2, 3, 900, 64)) * 2, mx.random.normal((2, 3, 900, 64))
        for begin in (0, 700, 900 - n_queries):
            end = {0: 700, 700: 900 - n_queries}.get(begin, 900)
            cache.update_and_fetch(keys[:, :, begin:end], values[:, :, begin:end])
        decoded_k = [cache.sink_keys, cache.key_codec.decode(cache.compressed_keys), cache.recent_keys]
        decoded_v = [
            cache.sink_values,
            cache.value_codec.decode(cache.compressed_values),
            cache.recent_values,
        ]
        queries = mx.random.normal((2, 9, n_queries, 64))
        # every query sees the cache as stored, as the oracle does: on CPUs the queries of an
        # update that compressed tokens would otherwise see those exact (chunk-invariant
        # prefill, tested against its own oracle in tests/kv/test_chunk_invariance.py)
        cache.just_aged = None
        expected = mx.fast.scaled_dot_product_attention(
            queries,
            mx.concatenate(decoded_k, axis=2),
            mx.concatenate(decoded_v, axis=2),
            scale=0.125,
            mask="causal" if n_queries > 1 else None,
        )
        got = turboquant_attention(queries, cache, 0.125)
        worst = max(worst, mx.max(mx.abs(got - expected)).item())
    return worst


def random_fill(model, cache: list, n: int, chunk: int) -> None:
    """Stores n random keys/values of the model's shapes in every layer's cache, through
    the caches' own update path (TurboQuant compresses them as a prefill would)."""
    config = model.args
    heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype = activation_dtype(model)  # what the model's own attention would store
    mx.random.seed(n)
    for c in cache:
        for i in range(0, n, chunk):
            shape = (1, heads, min(chunk, n - i), head_dim)
            c.update_and_fetch(mx.random.normal(shape).astype(dtype), mx.random.normal(shape).astype(dtype))
            mx.eval(c.state)


def activation_dtype(model) -> mx.Dtype:
    """The dtype of the model's activations: that of its floating parameters (for a quantized
    model, its scales)."""
    from mlx.utils import tree_flatten

    floating = (v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating))
    return next(floating, mx.float32)


def kernel_backend_name() -> str:
    """Which TurboQuant attention served: a fused-kernel backend (metal/) or the twin."""
    from services.core.kv.kernel_select import kernel_backend

    backend = kernel_backend()
    return backend.__name__ if backend is not None else "twin (pure MLX)"


def run_once(
    model, kind: str, settings: KVCacheSettings, tokens: list[int], decode: int, chunk: int, fill: bool
) -> dict:
    cache = make_kv_cache(model, kind, settings)
    prompt = mx.array(tokens[:-1])[None]
    mx.synchronize()
    start = time.perf_counter()
    if fill:
        random_fill(model, cache, prompt.shape[1], chunk)
    else:
        for i in range(0, prompt.shape[1], chunk):
            model(prompt[:, i : i + chunk], cache=cache)
            mx.eval([c.state for c in cache])
    prefill_s = time.perf_counter() - start
    token = mx.array(tokens[-1:])
    mx.eval(token)
    start = time.perf_counter()
    for _ in range(decode):
        logits = model(token[:, None], cache=cache)
        token = mx.argmax(logits[:, -1], axis=-1)
        mx.eval(token)
    decode_s = time.perf_counter() - start
    total = kv_cache_bytes(cache)
    context = len(tokens) + decode
    out = {
        "prefill_tok_s": None if fill else round(prompt.shape[1] / prefill_s, 2),
        "decode_tok_s": round(decode / decode_s, 2),
        "kv_bytes": total,
        "kv_bytes_per_token": round(total / context, 1),
        "exact_kv_dtype": str(cache[0].state[0].dtype).removeprefix("mlx.core."),
    }
    tq = [c for c in cache if isinstance(c, TurboQuantKVCache)]
    if tq and tq[0].compressed_length:
        compressed = sum(
            c.compressed_keys.nbytes + c.compressed_values.nbytes for c in tq if c.compressed_length
        )
        out["compressed_bytes_per_token"] = round(compressed / max(1, tq[0].compressed_length), 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="mlx-lm checkpoint (default: the demo model's dense twin)"
    )
    parser.add_argument("--dtype", default=None, choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--dequantize", action="store_true", help="float32 weights (fast on a CPU)")
    parser.add_argument(
        "--dense-kernel",
        action="store_true",
        help="quantized projections on core's CPU kernel (metal/linear_cpu.py)",
    )
    parser.add_argument(
        "--random-weights", action="store_true", help="the model's shapes from its config, random weights"
    )
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=2048, help="prefill chunk (mlx-lm's default step)")
    parser.add_argument(
        "--random-fill",
        action="store_true",
        help="decode only: fill the caches with random keys/values instead of prefilling the prompt "
        "(a 16K-token prefill takes hours on a small CPU; decode speed does not depend on the contents)",
    )
    add_kv_cache_flags(parser)  # the TurboQuant settings to time (--kv-cache itself is ignored here)
    args = parser.parse_args()

    model, tokenizer, args.model = load_bench_model(args.model, args.dtype, args.random_weights)
    if args.dequantize:
        from mlx_lm.utils import dequantize_model

        model = dequantize_model(model)
        model.set_dtype(getattr(mx, args.dtype or "float32"))
    on_kernel = 0
    if args.dense_kernel:
        from metal.linear_cpu import use_cpu_kernels

        on_kernel = use_cpu_kernels(model)
        if not on_kernel:
            raise SystemExit(
                "--dense-kernel: no projection moved (quantized weights and the C extension needed)"
            )
    settings = kv_settings_from_args(args)
    config = model.args
    heads = getattr(config, "num_key_value_heads", None)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layers = len(model.layers)
    result = {
        "bench": "kv",
        "model": Path(args.model).name,
        "device": str(mx.default_device()),
        "machine": platform.machine(),
        "settings": settings.describe() + f", sinks {settings.sink_tokens}, window {settings.recent_window}",
        "head_dim": head_dim,
        "fp16_bytes_per_token": 2 * 2 * layers * heads * head_dim,
        "weights": ("random, " if args.random_weights else "")
        + ("float32 (dequantized)" if args.dequantize else "as stored")
        + (f", {on_kernel} projections on core's CPU kernel" if on_kernel else ""),
        "twin_max_abs_error": round(twin_error(), 7),
        "kernels": kernel_backend_name(),
        "rounds": args.rounds,
        "filled_with": "random keys/values (decode only)" if args.random_fill else "the prompt's prefill",
        "decode_tokens": args.decode_tokens,
        "contexts": {},
    }
    for n in args.contexts:
        tokens = prompt_tokens(tokenizer, n)
        best: dict[str, dict] = {}
        for _ in range(args.rounds):
            for kind in ("fp16", "turboquant"):
                r = run_once(model, kind, settings, tokens, args.decode_tokens, args.chunk, args.random_fill)
                prev = best.get(kind)
                if prev is None:
                    best[kind] = r
                else:
                    if r["prefill_tok_s"] is not None:
                        prev["prefill_tok_s"] = max(prev["prefill_tok_s"], r["prefill_tok_s"])
                    prev["decode_tok_s"] = max(prev["decode_tok_s"], r["decode_tok_s"])
        fp, tq = best["fp16"], best["turboquant"]
        best["decode_ratio"] = round(tq["decode_tok_s"] / fp["decode_tok_s"], 3)
        if not args.random_fill:
            best["prefill_ratio"] = round(tq["prefill_tok_s"] / fp["prefill_tok_s"], 3)
        best["bytes_ratio_vs_fp16"] = round(result["fp16_bytes_per_token"] / tq["kv_bytes_per_token"], 2)
        if "compressed_bytes_per_token" in tq:
            best["compressed_ratio_vs_fp16"] = round(
                result["fp16_bytes_per_token"] / tq["compressed_bytes_per_token"], 2
            )
        result["contexts"][str(n)] = best
        print(json.dumps({"progress": n, **best}), file=sys.stderr, flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
