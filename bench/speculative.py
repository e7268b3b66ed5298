"""Speculative decoding: tok/s and expert hops per generated token, speculation on vs off, in one run.

    python bench/speculative.py                                  # the demo model, on this machine
    python bench/speculative.py --models qwen3-30b-a3b-4layer,qwen3-30b-a3b-48layer \
        --dtype bfloat16 --tokens 128                            # on a GPU: the shapes the targets name

Each model runs as core + 1 expert worker (real processes, Unix sockets, frames), once without
speculation and once per method (`ngram`; `draft:PATH`, where `draft:demo-dense` is the dense
SmolLM2-135M the demo MoE is made from; `mtp` on `deepseek-v3-mtp-tiny`, a random DeepSeek-V3 with its
MTP layer), on two greedy prompts: a code edit whose answer repeats
much of the prompt, and free chat. `hops_per_token` is core's layer calls over the decode divided by
MoE layers and decoded tokens: the steps each token costs (1.0 without drafts). `acceptance_length`
is 1 + accepted drafted tokens per verified draft: the tokens a drafting step yields. Greedy tokens
with speculation must equal those without (`tokens_match_off`); where they do not,
`first_difference` gives the first differing step and the gap between the top two logprobs there
without speculation (a near tie when small). `paired` compares, on the method's own core, requests
with drafts and requests sent with `speculative: false`, in turns, by their median tok/s: the ratio
least moved by the machine's drift between processes. With random weights (the synthetic
shapes) a prompt's meaning is lost: what their figures show is the mechanism's cost and the hop
count, not real acceptance.
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
import mlx.core as mx
import mlx_lm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.decode import greedy_token_request, spin_as_up, split_system
from bench.models import checkpoint, log
from bench.workdir import bench_workdir
from services.common.manifest import Manifest
from services.ops.up import resolve_split
from services.proto.moemesh.v1 import core_pb2, core_pb2_grpc

CODE_EDIT = (
    "Add type hints to this Python module and keep everything else the same.\n\n"
    "def area(width, height):\n    return width * height\n\n\n"
    "def perimeter(width, height):\n    return 2 * (width + height)\n\n\n"
    "def scale(width, height, factor):\n    return width * factor, height * factor\n\n\n"
    "def describe(width, height):\n"
    '    return f"a {width} by {height} rectangle with area {area(width, height)}"\n'
)
CHAT = "Tell me about the history of lighthouses and the people who kept them."
PROMPTS = {"code_edit": CODE_EDIT, "chat": CHAT}


def prompt_tokens(path: Path, text: str) -> list[int]:
    _, tokenizer = mlx_lm.load(str(path), lazy=True)
    messages = [{"role": "user", "content": text}]
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    tokens = list(tokenizer.encode(text, add_special_tokens=False))
    if not tokens:
        raise RuntimeError(f"{path}: its tokenizer gave no tokens for the prompt")
    return tokens


def decode(address: str, prompt: list[int], tokens: int, speculative: bool = True) -> dict:
    """One greedy generation after a warm-up: tokens, decode tok/s, layer calls, spec counters.
    speculative=False: this request alone decodes without drafts (the per-request switch)."""
    with grpc.insecure_channel(address) as channel:
        stub = core_pb2_grpc.CoreStub(channel)
        request = greedy_token_request(prompt, 4)
        request.speculative = speculative
        list(stub.Generate(request, timeout=600))  # warm-up
        before = stub.GetStats(core_pb2.GetStatsRequest()).speculative
        request.stopping.max_tokens = tokens
        out, first_at, first_count = [], None, 0
        for chunk in stub.Generate(request, timeout=3600):
            out.extend(chunk.token_ids)
            if first_at is None:
                first_at, first_count = time.perf_counter(), len(out)
                stub.GetStats(core_pb2.GetStatsRequest(reset_layer_calls=True))  # decode steps only
        seconds = time.perf_counter() - first_at
        stats = stub.GetStats(core_pb2.GetStatsRequest())
    spec = stats.speculative
    drafts = spec.drafts - before.drafts
    accepted = spec.accepted_tokens - before.accepted_tokens
    drafted = spec.draft_tokens - before.draft_tokens
    decoded = len(out) - first_count
    return {
        "tokens": out,
        "tok_s": decoded / seconds,
        "layer_calls": stats.layer_calls.calls,
        "decoded": decoded,
        "drafts": drafts,
        "acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
        "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
    }


def top2_gaps(address: str, prompt: list[int], tokens: int) -> tuple[list[int], list[float]]:
    """A greedy generation without speculation, with each step's gap between its top two logprobs:
    where another run's greedy tokens part from these, the gap says whether that step was a near tie."""
    with grpc.insecure_channel(address) as channel:
        stub = core_pb2_grpc.CoreStub(channel)
        request = greedy_token_request(prompt, tokens)
        request.logprobs, request.top_logprobs = True, 2
        out, gaps = [], []
        for chunk in stub.Generate(request, timeout=3600):
            out.extend(chunk.token_ids)
            for step in chunk.logprobs:
                top = sorted((t.logprob for t in step.top), reverse=True)
                gaps.append(round(top[0] - top[1], 5) if len(top) > 1 else None)
    return out, gaps


def first_difference(tokens: list[int], reference: list[int], gaps: list[float]) -> dict | None:
    step = next((i for i, (a, b) in enumerate(zip(tokens, reference, strict=False)) if a != b), None)
    if step is None:
        return None
    return {"step": step, "top2_logprob_gap": gaps[step] if step < len(gaps) else None}


def paired(on: list[dict], off: list[dict]) -> dict:
    """Requests with and without drafts in turns on the same core: the ratio of their median tok/s,
    which the machine's drift between processes does not move."""
    on_median, off_median = median(r["tok_s"] for r in on), median(r["tok_s"] for r in off)
    return {
        "rounds": len(on),
        "tok_s_median": round(on_median, 3),
        "off_tok_s_median": round(off_median, 3),
        "ratio_median": round(on_median / off_median, 3),
    }


def bench_model(name: str, methods: list[str], tokens: int, rounds: int, dtype: str, k: int) -> dict:
    path = checkpoint(name, dtype)
    split = resolve_split(str(path))
    moe_layers = len(Manifest.load(split).layers)
    prompts = {key: prompt_tokens(path, text) for key, text in PROMPTS.items()}
    workdir = bench_workdir("mm-spec-")
    runs: dict[str, dict[str, list[dict]]] = {}
    for mode in ["off", *methods]:
        method = mode
        if mode == "draft:demo-dense":  # the dense SmolLM2 the demo MoE was made from
            from services.tools.demo_model import ensure_demo_model

            method = f"draft:{ensure_demo_model(dense=True)}"
        flags = [] if mode == "off" else ["--speculative", method, "--num-speculative-tokens", str(k)]
        log(f"{name}: core + 1 worker, speculation {mode}")
        with split_system(split, workdir, 1, spin_as_up(1), flags) as (address, _):
            if mode == "off":
                references = {key: top2_gaps(address, prompt, tokens) for key, prompt in prompts.items()}
            for key, prompt in prompts.items():
                for round_index in range(rounds):
                    log(f"{name}: {mode} {key} round {round_index + 1}/{rounds}")
                    # with a method: a request without drafts beside each one with, in turns
                    pair = (
                        [True] if mode == "off" else [True, False] if round_index % 2 == 0 else [False, True]
                    )
                    for speculative in pair:
                        run = decode(address, prompt, tokens, speculative)
                        run["hops_per_token"] = round(
                            run["layer_calls"] / moe_layers / max(1, run["decoded"]), 3
                        )
                        lane = mode if speculative else f"{mode}/off"
                        runs.setdefault(lane, {}).setdefault(key, []).append(run)
    report = {"checkpoint": str(path), "moe_layers": moe_layers, "decode_tokens": tokens, "prompts": {}}
    for key, prompt in prompts.items():
        off = max(runs["off"][key], key=lambda r: r["tok_s"])
        entry = {
            "prompt_tokens": len(prompt),
            "off": {"tok_s": round(off["tok_s"], 3), "hops_per_token": off["hops_per_token"]},
        }
        for method in methods:
            best = max(runs[method][key], key=lambda r: r["tok_s"])
            entry[method] = {
                "tok_s": round(best["tok_s"], 3),
                "ratio_vs_off": round(best["tok_s"] / off["tok_s"], 3),
                "hops_per_token": best["hops_per_token"],
                "acceptance_length": best["acceptance_length"],
                "acceptance_rate": best["acceptance_rate"],
                "tokens_match_off": all(r["tokens"] == off["tokens"] for r in runs[method][key]),
                "paired": paired(runs[method][key], runs[f"{method}/off"][key]),
            }
            reference, gaps = references[key]
            if reference == off["tokens"]:  # the logprobs run decoded as the timed one did
                entry[method]["first_difference"] = first_difference(best["tokens"], reference, gaps)
        report["prompts"][key] = entry
    return report


def main() -> None:
    from services.common.logging import configure_logging

    configure_logging("bench", "warning")  # logs to stderr: stdout carries only the JSON
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models",
        default="demo",
        help="demo, qwen3-30b-a3b-<N>layer, deepseek-v3-mtp-tiny, qwen3.5-mtp-tiny or a path (comma-separated)",
    )
    parser.add_argument(
        "--methods",
        default="ngram,draft:demo-dense",
        help="speculative methods to compare with off; draft:demo-dense is the demo's dense twin",
    )
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--dtype", default="float32", help="synthetic models' dtype (bfloat16 on GPUs)")
    args = parser.parse_args()
    methods = [m for m in args.methods.split(",") if m]
    report = {
        "bench": "speculative",
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, mlx {mx.__version__} on {mx.default_device()}",
        "num_speculative_tokens": args.num_speculative_tokens,
        "note": "best of rounds; paired: medians of turns with and without drafts on the method's core; greedy; core + 1 expert worker on this host",
        "models": {
            name: bench_model(
                name, methods, args.tokens, args.rounds, args.dtype, args.num_speculative_tokens
            )
            for name in args.models.split(",")
        },
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
