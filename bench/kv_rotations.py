"""Does TurboQuant's rotation, its seed or one knob move the quality? Perplexity per (rotation, seed).

    python bench/kv_rotations.py --rotations hd haar hdhd --seeds 0 100 200
    python bench/kv_rotations.py --settings "K4/V3 (default)" --seeds 0 100 200
    python bench/kv_rotations.py --also sink_tokens=64 --also center_keys=1   # each setting changed so, too

hd: the randomized Walsh-Hadamard transform moe-mesh uses (services/core/kv/rotation.py);
haar: a Haar-random orthogonal matrix (the paper's rotation); hdhd: two randomized
Hadamards in a row. All three are dense P x P matrices here, so kernels and twin read any of
them unchanged; only the matrix is swapped (in this process). Same text and chunking as
bench/kv_quality.py; prints one JSON object (progress lines on stderr).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kv_quality import SETTINGS, TEXT
from services.core.kv import cache as kv_cache
from services.core.kv import make_kv_cache, rotation
from services.tools.kv_quality import load_bench_model, perplexity

DEFAULT_SETTINGS = [
    "K4/V3 (default)",
    "K3+QJL/V3 (paper)",
    "K4/V4",
    "K3+QJL/V3, centered keys",
    "K3+QJL/V3, window 384",
]
_HADAMARD_INIT = rotation.RandomizedHadamard.__init__


def use_rotation(kind: str) -> None:
    """Every codec made from now on rotates with `kind` (seeded as the codec's own seed)."""

    def init(self, dim: int, seed: int) -> None:
        _HADAMARD_INIT(self, dim, seed)
        if kind == "hd":
            return
        if kind == "haar":
            matrix = rotation.random_orthogonal(self.padded, seed + 104729)
        else:  # hdhd: a second randomized Hadamard after the first
            signs = np.random.default_rng(seed + 31).choice([-1.0, 1.0], size=self.padded)
            second = signs[:, None] * rotation.hadamard(self.padded) / math.sqrt(self.padded)
            matrix = np.array(self.matrix) @ second
        self.matrix = mx.array(matrix.astype(np.float32))
        self.matrix_t = mx.array(matrix.T.astype(np.float32))

    rotation.RandomizedHadamard.__init__ = init
    kv_cache.shared_codec.cache_clear()  # codecs are shared per (shape, seed): rebuild them


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the demo model's dense twin")
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rotations", nargs="+", default=["hd"], choices=["hd", "haar", "hdhd"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--settings", nargs="+", default=DEFAULT_SETTINGS, choices=sorted(SETTINGS))
    parser.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="FIELD=INT[,FIELD=INT]",
        help="also run every setting with this KVCacheSettings field changed (repeatable)",
    )
    args = parser.parse_args()
    model, tokenizer, path = load_bench_model(args.model, args.dtype)
    ids = tokenizer.encode(TEXT.read_text())[: args.tokens + 1]
    base = perplexity(model, ids, make_kv_cache(model, "fp16"))
    changes = [{}] + [
        {k: int(v) for k, v in (pair.split("=", 1) for pair in item.split(","))} for item in args.also
    ]
    variants = [(name, change) for name in args.settings for change in changes]
    rows = []
    for seed in args.seeds:
        for kind in args.rotations:
            use_rotation(kind)
            for name, change in variants:
                settings = dataclasses.replace(SETTINGS[name], **change, seed=seed)
                ppl = perplexity(model, ids, make_kv_cache(model, "turboquant", settings))
                label = name + "".join(f", {k}={v}" for k, v in change.items())
                row = {"setting": label, "rotation": kind, "seed": seed, "ppl": round(ppl, 4)}
                row["increase_pct"] = round(100 * (ppl / base - 1), 2)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    summary = {}
    for name in dict.fromkeys(r["setting"] for r in rows):
        for kind in args.rotations:
            values = [r["increase_pct"] for r in rows if r["setting"] == name and r["rotation"] == kind]
            summary[f"{name} / {kind}"] = {
                "mean": round(float(np.mean(values)), 2),
                "min": min(values),
                "max": max(values),
            }
    print(
        json.dumps(
            {
                "bench": "kv_rotations",
                "model": Path(path).name,
                "device": str(mx.default_device()),
                "tokens": args.tokens,
                "fp16_ppl": round(base, 4),
                "summary": summary,
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
