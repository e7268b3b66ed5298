"""How long decoding streams wait while a long prompt is prefilled beside them, with and without
core's step-time target (`--max-step-seconds`), in one run.

    python bench/prefill_stall.py                          # demo model, targets 0 (tokens only) and 1 s
    python bench/prefill_stall.py --targets 0 0.5 2 --rules 90

Per target: a fresh core (and two expert workers) with `--max-num-batched-tokens 512`; 4 greedy
streams decode, then a prompt of `--rules` rules (~25 tokens each) arrives; reported are its
prefill time and, for the 4 streams during that prefill, the tokens each got and the largest gap
between two of their tokens, next to the median gap before the prompt came (bench/concurrency.py's
`interleave`). With `--alone`, then the same prompt with nothing decoding and a short request
sent 1 s after it: the prompt's prefill time and the short request's time to first token (a prompt
alone is paced to 4x the target, so the short one starts at the next step boundary).
Prints one JSON object; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import platform
import sys
from pathlib import Path

import grpc
import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.concurrency import RULES, chat, interleave, timed_stream
from bench.decode import log, spin_as_up, split_system
from bench.workdir import bench_workdir
from services.ops.up import resolve_split
from services.proto.moemesh.v1 import core_pb2_grpc


async def behind_a_prompt_alone(stub, prompt: str) -> dict:
    """The long prompt prefilled with nothing decoding; 1 s in, a short request arrives: how long
    it waits to start, and what the long prompt's prefill costs (chunks cut to time, or not)."""
    long_call = asyncio.create_task(timed_stream(stub, chat(prompt, 1)))
    await asyncio.sleep(1.0)
    short = await timed_stream(stub, chat("What is two plus two?", 2))
    long = await long_call
    return {
        "prompt_tokens": long["usage"].prompt_tokens,
        "prefill_alone_s": round(long["arrivals"][0] - long["sent"], 3),
        "short_request_first_token_s": round(short["arrivals"][0] - short["sent"], 3),
    }


async def measure(address: str, prompt: str, alone: bool) -> dict:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = core_pb2_grpc.CoreStub(channel)
        result = await interleave(stub, prompt)
        if alone:  # the same rules in another order: no prefix to reuse from the run above
            reordered = "Read these rules from the last. " + " ".join(reversed(prompt.split(". ")))
            result["alone"] = await behind_a_prompt_alone(stub, reordered)
        return result


def run_target(split: Path, target: float, prompt: str, alone: bool) -> dict:
    flags = ["--max-num-batched-tokens", "512", "--max-step-seconds", str(target)]
    with split_system(split, bench_workdir("mm-stall-"), 2, spin_as_up(2), flags) as (address, _):
        return asyncio.run(measure(address, prompt, alone))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--targets", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--rules", type=int, default=45, help="length of the long prompt (~25 tokens a rule)")
    parser.add_argument(
        "--alone",
        action="store_true",
        help="also prefill the prompt with nothing decoding, a short request arriving 1 s in",
    )
    args = parser.parse_args()
    from services.common.logging import configure_logging

    configure_logging("bench", "warning")
    prompt = "You are a careful assistant. " + " ".join(RULES[: args.rules])
    with contextlib.redirect_stdout(sys.stderr):
        split = resolve_split(None)  # the demo model
    result = {
        "bench": "prefill_stall",
        "machine": f"{platform.system()} {platform.machine()}, mlx {mx.__version__} on {mx.default_device()}",
        "model": "demo",
        "max_num_batched_tokens": 512,
        "targets": {},
    }
    for target in args.targets:
        log(f"--max-step-seconds {target}")
        result["targets"][str(target)] = run_target(split, target, prompt, args.alone)
        log(json.dumps(result["targets"][str(target)]))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
