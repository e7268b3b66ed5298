"""Where a split decode loses to monolithic mlx-lm before any hop: the model or the generator.

    python bench/model_overhead.py [--model qwen3-30b-a3b-4layer|demo|PATH] [--dtype bfloat16]

One sequence, greedy, `--tokens` tokens, ms per token (the first two steps left out), for:
  mono_generate_step     mlx-lm's model under mlx-lm's generate_step (monolithic decode)
  mono_batch_generator   the same model under mlx-lm's BatchGenerator
  mono_engine_step       the same model stepped as core's engine steps it (sequence_batch.py,
                         batch_step.py: BatchStep, which leaves the decode mask out of an unpadded batch)
  core_generate_step     core's model (model_loader.py) with every expert local and in its graph
                         (expert_link/local.py), under generate_step
  core_batch_generator   that model under BatchGenerator
  core_engine_step       that model stepped as core's engine steps it
core vs mono is the price of the surgery (same math: tests/core/test_local_experts.py), batch
generator vs generate_step the price of mlx-lm's batching at one sequence. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import BatchGenerator, generate_step, generation_stream

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decode import checkpoint, log
from services.common.manifest import Manifest
from services.core.batch_step import BatchStep
from services.core.expert_link.local import LocalExperts
from services.core.expert_link.local_spec import LocalExpertsSpec
from services.core.model_loader import load_core_model
from services.core.sequence_batch import SequenceBatch
from services.ops.up import resolve_split


def ms_per_token(stamps: list[float]) -> float:
    return 1e3 * (stamps[-1] - stamps[1]) / (len(stamps) - 2)


def under_generate_step(model, prompt: list[int], tokens: int) -> float:
    stamps = [time.perf_counter() for _ in generate_step(mx.array(prompt), model, max_tokens=tokens)]
    return ms_per_token(stamps)


def greedy(logprobs):
    return mx.argmax(logprobs, axis=-1)


def stepped(advance, tokens: int) -> float:
    stamps: list[float] = []
    while len(stamps) < tokens - 1:
        if advance():
            stamps.append(time.perf_counter())
    return ms_per_token(stamps)


def under_batch_generator(model, prompt: list[int], tokens: int) -> float:
    """ms per token of one sequence in mlx-lm's BatchGenerator."""
    generator = BatchGenerator(model, max_tokens=tokens, sampler=greedy)
    generator.insert([prompt], [tokens])
    return stepped(lambda: generator.next()[1], tokens)


def under_engine_step(model, prompt: list[int], tokens: int) -> float:
    """ms per token of one sequence stepped as core's engine steps it."""
    batch = SequenceBatch(model, max_sequences=32, prefill_chunk=2048)
    batch.insert([prompt], tokens, sampler=greedy)

    def advance() -> list:
        with mx.stream(generation_stream):
            step = BatchStep(batch)
            return step.finish([task() for task in step.tasks])[1]

    return stepped(advance, tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-30b-a3b-4layer")
    parser.add_argument("--dtype", default="float32", help="synthetic model's dtype (bfloat16 on GPUs)")
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    path = checkpoint(args.model, args.dtype)
    split = resolve_split(str(path))
    prompt = list(range(1000, 1024))
    report: dict = {
        "bench": "model_overhead",
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, mlx {mx.__version__} on {mx.default_device()}",
        "model": args.model,
        "dtype": args.dtype,
        "decode_tokens": args.tokens,
    }
    log("monolithic mlx-lm")
    mono, _ = mlx_lm.load(str(path))
    under_generate_step(mono, prompt, 16)  # warm-up: kernels compiled, weights where they will stay
    report["mono_generate_step_ms"] = round(under_generate_step(mono, prompt, args.tokens), 3)
    report["mono_batch_generator_ms"] = round(under_batch_generator(mono, prompt, args.tokens), 3)
    report["mono_engine_step_ms"] = round(under_engine_step(mono, prompt, args.tokens), 3)
    del mono
    log("core's model, every expert local and in its graph")
    manifest = Manifest.load(split)
    local = LocalExperts(split, manifest, LocalExpertsSpec(), kernel="mlx")
    core, _ = load_core_model(split, manifest, None, local_modules=local.modules())
    under_generate_step(core, prompt, 16)
    report["core_generate_step_ms"] = round(under_generate_step(core, prompt, args.tokens), 3)
    report["core_batch_generator_ms"] = round(under_batch_generator(core, prompt, args.tokens), 3)
    report["core_engine_step_ms"] = round(under_engine_step(core, prompt, args.tokens), 3)
    local.close()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
