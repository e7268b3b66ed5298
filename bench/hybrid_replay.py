"""What replaying a hybrid model's recurrent layers costs a speculative verify step, in one run.

    python bench/hybrid_replay.py                        # this machine, float32
    python bench/hybrid_replay.py --dtype bfloat16       # on a GPU

A random Qwen3.5-MoE language model at the shape of Qwen3.5-35B-A3B's layers (hidden 2048, Gated
DeltaNet and full attention 3:1, 256 experts top-8; fewer layers and a small vocabulary, which the
ratios do not depend on), in core's process with every expert local. After a prompt of `--context`
tokens in each of `--batch` rows, it times, median ms over `--steps`:

- a plain decode step (one position per row);
- a verify forward of 1 + K positions per row, as a model without recurrent layers runs it;
- the same verify armed, and settled with the rejected positions of each row replayed out of the
  recurrent layers (services/core/speculative/recurrent_rows.py): every row keeps one drafted token,
  the worst case, where the most positions are replayed out;
- that settled verify with the replay computing the input projections again, as running the whole
  layer again would, instead of reusing the verify forward's.

`replay_ms` is the difference of the last two; `settled_vs_verify` their ratio.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.timing import timed
from services.common.mlx_lm_adapter import classes_for_config
from services.core.speculative.recurrent_rows import recurrent_rows

SHAPE = {  # Qwen3.5-35B-A3B's text layers
    "model_type": "qwen3_5_moe",
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_value_heads": 32,
    "linear_num_key_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 4,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "intermediate_size": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_parameters": {"type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
}


def build(layers: int, dtype: mx.Dtype, vocab: int):
    config = {
        "model_type": "qwen3_5_moe",
        "text_config": {**SHAPE, "num_hidden_layers": layers, "vocab_size": vocab},
    }
    model_class, args_class = classes_for_config(config)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def measure(model, batch: int, context: int, k: int, steps: int, vocab: int) -> dict:
    rows = recurrent_rows(model)
    cache = make_prompt_cache(model)
    mx.random.seed(0)
    model(mx.random.randint(0, vocab, (batch, context)), cache=cache)
    mx.eval([c.state for c in cache])
    width = 1 + k
    one, wide = mx.random.randint(0, vocab, (batch, 1)), mx.random.randint(0, vocab, (batch, width))

    def trim(n: int) -> None:  # the attention layers' caches back to the context's length
        for c in cache:
            if type(c) is KVCache:
                c.trim(n)

    def plain() -> None:
        mx.eval(model(one, cache=cache))
        trim(1)

    def verify() -> None:
        mx.eval(model(wide, cache=cache))
        trim(width)

    def settled(reuse: bool = True) -> None:
        rows.arm(cache)
        logits = model(wide, cache=cache)
        mx.eval(logits)
        if not reuse:
            for mixer in rows.mixers.values():
                mixer.forget_projections()
        rows.settle(cache, [width - 2] * batch)  # the pending token and one draft kept
        mx.eval([c.state for c in cache])
        trim(width)

    def recomputed() -> None:
        settled(reuse=False)

    out = {
        name: timed(step, steps, warmup=3)["p50_us"] / 1e3
        for name, step in (
            ("plain_step_ms", plain),
            ("verify_ms", verify),
            ("settled_ms", settled),
            ("settled_recomputing_projections_ms", recomputed),
        )
    }
    out["replay_ms"] = out["settled_ms"] - out["verify_ms"]
    out["settled_vs_verify"] = out["settled_ms"] / out["verify_ms"]
    out["settled_vs_plain"] = out["settled_ms"] / out["plain_step_ms"]
    out["replay_recomputing_projections_ms"] = out["settled_recomputing_projections_ms"] - out["verify_ms"]
    return {k: round(v, 3) for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (3 of 4 Gated DeltaNet)")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--vocab", type=int, default=4096)
    args = parser.parse_args()
    model = build(args.layers, getattr(mx, args.dtype), args.vocab)
    report = {
        "bench": "hybrid_replay",
        "machine": f"{platform.system()} {platform.machine()}, mlx {mx.__version__} on {mx.default_device()}",
        "shape": "Qwen3.5-35B-A3B layers (hidden 2048, 256 experts top-8), random weights",
        "dtype": args.dtype,
        "layers": args.layers,
        "context": args.context,
        "num_speculative_tokens": args.num_speculative_tokens,
        "batches": {},
    }
    for batch in (int(b) for b in args.batches.split(",")):
        print(f"[bench] batch {batch}", file=sys.stderr, flush=True)
        report["batches"][str(batch)] = measure(
            model, batch, args.context, args.num_speculative_tokens, args.steps, args.vocab
        )
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
