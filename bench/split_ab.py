"""Two settings of the split system, A/B in one run: decode tok/s on the demo model.

    python bench/split_ab.py --compare spin [--workers 1] [--rounds 4] [--tokens 64]
    python bench/split_ab.py --compare overlap --workers 1 --rounds 6
    python bench/split_ab.py --compare spin --model qwen3-30b-a3b-4layer --dtype bfloat16   # a GPU host
    python bench/split_ab.py --compare dense --workers 1 --rounds 3 --prefill-tokens 512

Core and N workers as real processes on Unix sockets, the variants interleaved round by round
so that drift in machine speed hits them alike. Per round: decode tok/s and core's
per-layer-call transport and worker compute p50 (decode steps only).
  spin     frame reads poll for up to 10 ms before they sleep, or sleep at once
           (`--frame-spin-us`). Polling pays off only where every process has a core of its
           own, the rule `moe-mesh up` applies (services.common.frames.spin_for).
  overlap  core builds the next layer while a layer's experts compute, or waits for them
           (`--expert-overlap on|off`); reads poll as `moe-mesh up` would choose. An overlapped
           call's time includes the building, so its transport figure is not comparable.
  dense    core's quantized projections through its C kernel or MLX's own op (`--dense-kernel
           auto|mlx`); also times a prefill of --prefill-tokens tokens of the GPL-3 text in
           tests/assets (prefix cache off in both, so every prompt is computed).
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from statistics import median

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decode import PROMPT, checkpoint, spin_as_up, split_system, timed_decode
from bench.workdir import bench_workdir
from services.ops.up import resolve_split
from services.proto.moemesh.v1 import core_pb2, core_pb2_grpc


def variants(compare: str, workers: int) -> dict[str, tuple[int, list[str]]]:
    """name -> (frame spin in us for core and workers, extra `moe-mesh core` flags)."""
    if compare == "spin":
        return {"sleep": (0, []), "poll_10ms": (10_000, [])}
    spin_us = spin_as_up(workers)
    if compare == "dense":
        no_reuse = ["--prefix-cache-gb", "0"]
        return {
            "c_kernel": (spin_us, ["--dense-kernel", "auto", *no_reuse]),
            "mlx": (spin_us, ["--dense-kernel", "mlx", *no_reuse]),
        }
    return {
        "overlap": (spin_us, ["--expert-overlap", "on"]),
        "no_overlap": (spin_us, ["--expert-overlap", "off"]),
    }


def timed_prefill(core_address: str, prompt: list[int]) -> float:
    """Seconds from sending `prompt` to its first token (a one-token greedy request)."""
    with grpc.insecure_channel(core_address) as channel:
        request = core_pb2.GenerateRequest(
            token_ids=core_pb2.TokenIds(ids=prompt),
            sampling=core_pb2.SamplingParams(temperature=0),
            stopping=core_pb2.StoppingCriteria(max_tokens=1, ignore_eos=True),
        )
        started = time.perf_counter()
        list(core_pb2_grpc.CoreStub(channel).Generate(request, timeout=3600))
        return time.perf_counter() - started


def one_run(
    split: Path,
    prompt: list[int],
    workers: int,
    spin_us: int,
    core_flags: list[str],
    tokens: int,
    long_prompt: list[int] | None = None,
) -> dict:
    workdir = bench_workdir("mm-ab-")
    with split_system(split, workdir, workers, spin_us, core_flags) as (address, _):
        _, stamps, calls = timed_decode(address, prompt, tokens)
        prefill_s = timed_prefill(address, long_prompt) if long_prompt else None
    run = {
        "tok_s": round((len(stamps) - 1) / (stamps[-1] - stamps[0]), 3),
        "transport_p50_us": round(calls.transport_p50_us, 1),
        "compute_p50_us": round(calls.compute_p50_us, 1),
    }
    if prefill_s is not None:
        run["prefill_s"] = round(prefill_s, 3)
        run["prefill_tok_s"] = round(len(long_prompt) / prefill_s, 2)
    return run


def main() -> None:
    import mlx.core as mx
    import mlx_lm

    from services.common.logging import configure_logging

    configure_logging("bench", "warning")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", choices=["spin", "overlap", "dense"], required=True)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--model", default="demo", choices=["demo", "qwen3-30b-a3b-4layer"])
    parser.add_argument("--dtype", default="float32", help="the synthetic model's dtype")
    parser.add_argument("--prefill-tokens", type=int, default=0, help="also time a prefill this long (demo)")
    args = parser.parse_args()
    path = checkpoint(args.model, args.dtype)
    split = resolve_split(str(path))
    if args.model == "demo":
        _, tokenizer = mlx_lm.load(str(path), lazy=True)
        prompt = tokenizer.encode(PROMPT)
        text = (Path(__file__).resolve().parents[1] / "tests" / "assets" / "gpl-3.0.txt").read_text()
        long_prompt = tokenizer.encode(text)[: args.prefill_tokens] or None
    else:  # random weights: the prompt's length is what counts
        prompt = list(range(1000, 1024))
        long_prompt = list(range(1000, 1000 + args.prefill_tokens)) or None
    settings = variants(args.compare, args.workers)
    rounds: dict[str, list[dict]] = {name: [] for name in settings}
    for index in range(args.rounds):
        for name, (spin_us, core_flags) in settings.items():
            run = one_run(split, prompt, args.workers, spin_us, core_flags, args.tokens, long_prompt)
            rounds[name].append(run)
            print(json.dumps({"round": index + 1, name: rounds[name][-1]}), file=sys.stderr, flush=True)
    summary = {name: {key: median(r[key] for r in runs) for key in runs[0]} for name, runs in rounds.items()}
    print(
        json.dumps(
            {
                "bench": "split_ab",
                "compare": args.compare,
                "variants": settings,
                "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, {mx.default_device()}",
                "model": args.model,
                "workers": args.workers,
                "decode_tokens": args.tokens,
                "median_of_rounds": summary,
                "rounds": rounds,
                "command": "python bench/split_ab.py " + " ".join(sys.argv[1:]),
            }
        )
    )


if __name__ == "__main__":
    main()
