"""The models the benches run: the demo model, the Qwen3-30B-A3B shape cut to N layers
(random 4-bit weights, built once under $MOE_MESH_CACHE/bench), tiny multi-token-prediction
models, or a checkpoint folder."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from services.ops.up import cache_root
from services.tools.synthetic_model import QWEN3_30B_A3B_SHAPE, TINY_CONFIGS, build_random_checkpoint


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


SYNTHETIC_SHAPE = re.compile(r"qwen3-30b-a3b-(\d+)layer")
# Random models with a multi-token-prediction layer, for `--speculative mtp`: DeepSeek-V3's layout,
# and Qwen3.5's (a hybrid of linear and full attention)
TINY_BENCH_MODELS = {"deepseek-v3-mtp-tiny": "deepseek_v3_mtp", "qwen3.5-mtp-tiny": "qwen3_5_moe_mtp"}


def synthetic_name(layers: int) -> str:
    """The bench's name for the Qwen3-30B-A3B shape (hidden 2048, 128 experts, top-8, 4-bit)
    cut to `layers` layers."""
    return f"qwen3-30b-a3b-{layers}layer"


def checkpoint(name: str, dtype: str) -> Path:
    if name == "demo":
        from services.tools.demo_model import ensure_demo_model

        return ensure_demo_model()
    if name in TINY_BENCH_MODELS:  # a tiny random model of an architecture the Qwen3 shape lacks
        path = cache_root() / "bench" / f"{name}-{dtype}"
        if not (path / "config.json").exists():
            build_random_checkpoint(path, TINY_CONFIGS[TINY_BENCH_MODELS[name]], dtype=getattr(mx, dtype))
        return path
    shape = SYNTHETIC_SHAPE.fullmatch(name)
    if shape:
        path = cache_root() / "bench" / f"{name}-q4-{dtype}"
        if not (path / "config.json").exists():
            log(f"building the synthetic 4-bit {name} model in {path} (once)")
            build_random_checkpoint(
                path,
                {**QWEN3_30B_A3B_SHAPE, "num_hidden_layers": int(shape.group(1))},
                bits=4,
                group_size=64,
                dtype=getattr(mx, dtype),
            )
        return path
    return Path(name)
