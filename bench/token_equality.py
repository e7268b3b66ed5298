"""Greedy tokens compared with mlx-lm's: its batched path as a reference, and where runs part.

Used by bench/decode.py: a run whose tokens part from monolithic mlx-lm's is either computing
different math or meeting a near tie that rounding order alone decides; `first_differences`
says which by the logit gap where it parts."""

from __future__ import annotations

import time
from pathlib import Path

import mlx.core as mx
import mlx_lm


def batched_reference(path: Path, prompt: list[int], tokens: int) -> tuple[float, list[int]]:
    """mlx-lm's greedy decode through its own BatchGenerator, one sequence: the path core's engine
    drives (batched KV cache and attention), with mlx-lm's own expert module and no split. Returns
    (tokens per second after the first token, the tokens). Where monolithic `generate_step` and
    this part, mlx-lm's two paths part by themselves."""
    from mlx_lm.generate import BatchGenerator

    model, _ = mlx_lm.load(str(path))
    generator = BatchGenerator(model, sampler=lambda logprobs: mx.argmax(logprobs, axis=-1))
    generator.insert([prompt], [tokens])
    out: list[int] = []
    stamps: list[float] = []
    while len(out) < tokens:
        fresh = [int(response.token) for response in generator.next_generated()]
        out.extend(fresh)
        stamps += [time.perf_counter()] * len(fresh)
    generator.close()
    del model
    return (len(stamps) - 1) / (stamps[-1] - stamps[0]), out[:tokens]


def first_differences(path: Path, prompt: list[int], reference: list[int], runs: dict) -> dict:
    """{variant: where its greedy tokens first leave monolithic's} for the variants that do:
    the step, and at that step (monolithic's logits, the prefix teacher-forced) the gap between
    the top two logits and between monolithic's token and the variant's. A gap of ~1e-2 in
    bf16 is a near tie that rounding alone may flip; a wide gap is a wrong computation."""
    out = {}
    model = None
    for variant, tokens in runs.items():
        step = next((i for i, (a, b) in enumerate(zip(reference, tokens, strict=False)) if a != b), None)
        if step is None:
            continue
        model = model or mlx_lm.load(str(path))[0]
        logits = model(mx.array(prompt + reference[:step])[None])[0, -1].astype(mx.float32)
        top2 = mx.sort(logits)[-2:]
        out[variant] = {
            "step": step,
            "top2_gap": round((top2[1] - top2[0]).item(), 5),
            "chosen_gap": round((logits[reference[step]] - logits[tokens[step]]).item(), 5),
        }
    return out
