"""moe-mesh vs mlx-lm on one device: same checkpoint, same prompt — how close are the logits?

    python bench/equivalence.py [--dtype bfloat16] [--bits 4] [--arch qwen3_moe]

Prints one JSON object: the largest absolute and relative last-position logit difference and how
many of 32 greedy tokens agree, for a tiny random checkpoint with its experts on one and on three
real worker processes. On the CPU in float32 the answer is exactly 0 (the tests enforce < 1e-4);
this script exists to look at other devices and dtypes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import generate_step

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.workdir import bench_workdir
from services.core.model_loader import load_core_model
from services.tools.split import split_checkpoint
from services.tools.synthetic_model import TINY_CONFIGS, build_random_checkpoint
from tests.helpers import linked_dispatcher


def main() -> None:
    from services.common.logging import configure_logging

    configure_logging("bench", "warning")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="qwen3_moe", choices=sorted(TINY_CONFIGS))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--bits", type=int, default=4, help="0 keeps float weights")
    args = parser.parse_args()
    work = bench_workdir("mm-eq-")
    with contextlib.redirect_stdout(sys.stderr):  # mlx-lm prints while quantizing; stdout is for JSON
        source = build_random_checkpoint(
            work / "src", TINY_CONFIGS[args.arch], bits=args.bits or None, dtype=getattr(mx, args.dtype)
        )
    split = work / "split"
    split_checkpoint(source, split, progress=False)
    reference, tokenizer = mlx_lm.load(str(source))
    prompt = mx.array(list(range(1000, 1024)))
    want = reference(prompt[None])[0, -1].astype(mx.float32)
    want_tokens = [int(t) for t, _ in generate_step(prompt, reference, max_tokens=32)]
    report = {"device": str(mx.default_device()), "arch": args.arch, "dtype": args.dtype, "bits": args.bits}
    for ranges in (["0-7"], ["0-2", "3-5", "6-7"]):
        with linked_dispatcher(split, work, ranges, tag=f"w{len(ranges)}-") as (_, dispatcher, manifest):
            core, _ = load_core_model(split, manifest, dispatcher)
            got = core(prompt[None])[0, -1].astype(mx.float32)
            tokens = [int(t) for t, _ in generate_step(prompt, core, max_tokens=32)]
            agree = next((i for i, (a, b) in enumerate(zip(tokens, want_tokens, strict=True)) if a != b), 32)
            report[f"workers_{len(ranges)}"] = {
                "max_abs_logit_diff": mx.abs(got - want).max().item(),
                "max_rel_logit_diff": (mx.abs(got - want).max() / mx.abs(want).max()).item(),
                "greedy_tokens_agreeing_before_first_difference": agree,
            }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
