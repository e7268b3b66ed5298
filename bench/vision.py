"""Time to first token of chat turns with images: a first image, the same image again, text only.

    python bench/vision.py [--workers 1] [--rounds 5] [--image 448x336] [--families qwen3_vl_moe,...,gemma4]

Per family, a random checkpoint at bench sizes (services/tools/tiny_vlm_bench_sizes.py: a
12-block vision tower, an 8-layer MoE language model; Qwen3.5-MoE's with Gated DeltaNet layers,
Kimi-VL's with MLA attention and a MoonViT tower, MiniMax-M3-VL's with block-sparse attention and a
CLIP tower, Llama 4's with chunked attention and a tower on 336-pixel tiles, GLM-4.5V's with
GLM-4.5's language model, Step-3.7's with sliding windows and a Perception Encoder at 728 pixels,
Gemma 4's with image positions attending both ways) is split and served by a core and `--workers` expert workers as real processes (0: every expert in
core's process). Single greedy requests over gRPC,
one after another, 8 tokens each; per case the time to first token, ms:

  text_only                a text question as long as the image turn's prompt, new text each round
  first_image              a new image each round: vision tower, then the whole prompt's prefill
  repeated_image           the previous round's image and question again: the prefix cache holds
                           every position but the last
  same_image_new_question  an image seen before with a new question: the prefix cache reaches past
                           the image, the question's positions are prefilled
  same_image_new_system    an image seen before behind a new system prompt: the prefix cache stops
                           before the image, the vision tower's output comes from the image cache

Prints one JSON object, the families under "models".
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import platform
import sys
import time
from pathlib import Path

import grpc
import mlx.core as mx
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decode import log, spin_as_up, split_system
from bench.workdir import bench_workdir
from services.ops.up import cache_root
from services.proto.moemesh.v1 import core_pb2, core_pb2_grpc
from services.tools.split import split_checkpoint
from services.tools.tiny_vlm import build_tiny_vlm
from services.tools.tiny_vlm_bench_sizes import FAMILY_BENCH_SIZES

TOKENS = 8


def image(seed: int, size: tuple[int, int]) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def chat(question: str, picture: bytes | None, system: str = "") -> core_pb2.GenerateRequest:
    messages = [core_pb2.ChatMessage(role="system", content=system)] if system else []
    if picture is None:
        messages.append(core_pb2.ChatMessage(role="user", content=question))
    else:
        parts = [
            core_pb2.ContentPart(image=core_pb2.ImageInput(data=picture, media_type="image/png")),
            core_pb2.ContentPart(text=question),
        ]
        messages.append(core_pb2.ChatMessage(role="user", parts=parts))
    return core_pb2.GenerateRequest(
        chat=core_pb2.ChatInput(messages=messages),
        sampling=core_pb2.SamplingParams(temperature=0),
        stopping=core_pb2.StoppingCriteria(max_tokens=TOKENS, ignore_eos=True),
    )


async def ttft_ms(stub, message) -> tuple[float, int, int]:
    """(time to first token in ms, prompt tokens, of them cached)."""
    sent = time.perf_counter()
    first = None
    usage = None
    async for chunk in stub.Generate(message, timeout=3600):
        if first is None and chunk.token_ids:
            first = time.perf_counter()
        if chunk.HasField("usage"):
            usage = chunk.usage
    return round((first - sent) * 1e3, 1), usage.prompt_tokens, usage.cached_prompt_tokens


async def measure(address: str, rounds: int, size: tuple[int, int]) -> dict:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = core_pb2_grpc.CoreStub(channel)
        await ttft_ms(stub, chat("Warm up.", image(999, size)))
        cases: dict[str, list] = {
            name: []
            for name in (
                "text_only",
                "first_image",
                "repeated_image",
                "same_image_new_question",
                "same_image_new_system",
            )
        }
        image_tokens = (await ttft_ms(stub, chat("Count.", image(998, size))))[1]
        filler = " a" * (image_tokens - 12)  # one token each: as long as the image turn
        await ttft_ms(stub, chat(f"Warm up: {filler}", None))  # text prefill's first-use costs
        for r in range(rounds):
            picture = image(r, size)
            cases["text_only"].append(await ttft_ms(stub, chat(f"Round {r}: {filler}", None)))
            cases["first_image"].append(await ttft_ms(stub, chat(f"Describe image {r}.", picture)))
            cases["repeated_image"].append(await ttft_ms(stub, chat(f"Describe image {r}.", picture)))
            cases["same_image_new_question"].append(
                await ttft_ms(stub, chat(f"What colour dominates in image {r}?", picture))
            )
            cases["same_image_new_system"].append(
                await ttft_ms(stub, chat(f"Describe image {r}.", picture, system=f"Be brief, round {r}."))
            )
        out = {}
        for name, runs in cases.items():
            out[name] = {
                "ttft_ms": [t for t, _, _ in runs],
                "ttft_p50_ms": float(np.median([t for t, _, _ in runs])),
                "prompt_tokens": runs[0][1],
                "cached_tokens": [c for _, _, c in runs],
            }
            log(f"{name}: {out[name]}")
        return out


def measure_family(family: str, workers: int, rounds: int, size: tuple[int, int]) -> dict:
    root = cache_root() / "bench" / f"{family.replace('_', '-')}-bench"
    if not (root / "split" / "manifest.json").exists():
        log(f"building and splitting the bench {family} checkpoint in {root} (once)")
        build_tiny_vlm(root / "checkpoint", sizes=FAMILY_BENCH_SIZES[family], family=family)
        split_checkpoint(root / "checkpoint", root / "split", progress=False)
    flags = ["--max-num-seqs", "8"]
    with split_system(root / "split", bench_workdir(), workers, spin_as_up(workers), flags) as (address, _):
        cases = asyncio.run(measure(address, rounds, size))
    return {
        "model": f"random {family} at bench sizes (services/tools/tiny_vlm_bench_sizes.py), float32",
        "cases": cases,
        "repeated_vs_first": round(
            cases["repeated_image"]["ttft_p50_ms"] / cases["first_image"]["ttft_p50_ms"], 3
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--image", default="448x336", help="WIDTHxHEIGHT of the images sent")
    parser.add_argument("--families", default=",".join(FAMILY_BENCH_SIZES), help="comma-separated")
    args = parser.parse_args()
    from services.common.logging import configure_logging

    configure_logging("bench", "warning")  # logs to stderr: stdout carries only the JSON
    size = tuple(int(v) for v in args.image.split("x"))
    families = [f for f in args.families.split(",") if f]
    unknown = sorted(set(families) - set(FAMILY_BENCH_SIZES))
    if unknown:
        parser.error(
            f"--families: no bench checkpoint for {unknown}; choose from {sorted(FAMILY_BENCH_SIZES)}"
        )
    report = {
        "bench": "vision",
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, mlx {mx.__version__} on {mx.default_device()}",
        "image": args.image,
        "workers": args.workers,
        "models": {f: measure_family(f, args.workers, args.rounds, size) for f in families},
        "command": "python bench/vision.py " + " ".join(sys.argv[1:]),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
