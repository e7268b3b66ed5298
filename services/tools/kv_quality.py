"""Quality measurement of a KV cache: perplexity of a text run through the model in
chunks, the way a long prompt is prefilled (so tokens age into the compressed run)."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn


def perplexity(model, tokens: list[int], cache: list, chunk: int = 512) -> float:
    """exp(mean next-token NLL) of `tokens`, prefilling `cache` chunk by chunk."""
    if len(tokens) < 2:
        raise ValueError("perplexity needs at least two tokens")
    total, count = 0.0, 0
    inputs = mx.array(tokens[:-1])[None]
    targets = mx.array(tokens[1:])[None]
    for start in range(0, inputs.shape[1], chunk):
        logits = model(inputs[:, start : start + chunk], cache=cache).astype(mx.float32)
        loss = nn.losses.cross_entropy(logits, targets[:, start : start + chunk], reduction="sum")
        mx.eval(loss, [c.state for c in cache])
        total += loss.item()
        count += logits.shape[1]
    return math.exp(total / count)


def ensure_dense_demo_model(cache_dir=None):
    """The demo model's dense twin (SmolLM2-135M as an mlx-lm `llama` checkpoint), built
    once next to the demo model.

    Why: the demo MoE's MLP is the dense MLP split into 8 experts that all run (their sum
    is the dense output), and its attention, all a KV cache touches, is the same module
    with the same weights: both give perplexity 20.2809 on the first 512 tokens of the
    bundled text. The dense form needs no gathered expert matmul, so it runs on every
    MLX backend the same way; quality checks and the benchmark use it."""
    from pathlib import Path

    from services.tools import demo_model

    root = Path(cache_dir) if cache_dir else demo_model._default_cache_dir()
    out = root / "smollm2-135m-dense"
    if (out / "config.json").exists():
        return out
    cfg, dense, meta = demo_model._dense_llama_weights(demo_model.find_demo_gguf())
    cfg = dict(cfg, quantization={"group_size": demo_model.GROUP_SIZE, "bits": demo_model.BITS})
    tmp = root / f".smollm2-135m-dense.{__import__('os').getpid()}"
    demo_model._write_checkpoint(tmp, cfg, dense, meta)
    tmp.rename(out)
    return out


def load_bench_model(path: str | None = None, dtype: str | None = None, random_weights: bool = False):
    """(model, tokenizer, path) for the KV benches: `path`, or the demo model's dense twin, in `dtype`.

    random_weights: build the architecture from `path`'s config.json (quantized as it
    says) with mlx-lm's random initialisation instead of reading the weights. Speed does
    not depend on weight values, so a machine without the checkpoint (the GPU host takes
    64 MiB per transfer) can time the same shapes from config and tokenizer files alone."""
    from pathlib import Path

    import mlx.nn as nn
    import mlx_lm
    from mlx_lm.utils import load_config, load_tokenizer

    from services.common.mlx_lm_adapter import classes_for_config

    path = path or str(ensure_dense_demo_model())
    if random_weights:
        config = load_config(Path(path))
        model_class, args_class = classes_for_config(config)
        model = model_class(args_class.from_dict(config))
        quantization = config.get("quantization")
        if quantization:
            nn.quantize(model, group_size=quantization["group_size"], bits=quantization["bits"])
        mx.eval(model.parameters())
        tokenizer = load_tokenizer(Path(path))
    else:
        model, tokenizer = mlx_lm.load(path)
    if dtype:
        model.set_dtype(getattr(mx, dtype))
    return model, tokenizer, path
