"""Fuzz every decoder moe-mesh exposes to peers and users, with a count and a time budget each.

    python bench/fuzz.py [--inputs 1000000] [--seconds 600] [--targets expert_call,manifest,...]

Each target (bench/fuzz_targets.py) starts from valid seeds and feeds mutations of them (and of
the inputs it accepted) to one decoder: the worker's frame stream and ExpertCall handling on a
tiny random MoE split, Tensor decoding, the manifest, cluster.toml, safetensors headers, and the
OpenAI and Anthropic request mappers. A finding is an exception other than the decoder's own
refusal, an INTERNAL answer to a malformed call, or an input that takes over 10 s. Prints one
JSON object; exits 1 when anything was found.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.fuzz_targets import (
    CALL_CAP,
    Finding,
    Target,
    cluster_targets,
    expert_call_seeds,
    expert_call_target,
    frame_stream_target,
    manifest_target,
    mapper_targets,
    safetensors_target,
    tensor_target,
)

MAX_INPUT_BYTES = 64 * 1024  # a socket pair holds this without a reader, and it covers every seed
HANG_S = 10
CORPUS_LIMIT = 512


def worker_answer(split: Path):
    """A worker's `answer` (what Forward and the frame socket both call) over layers' experts 2-5
    of `split`, in this process; with its hidden size and experts."""
    from services.common.manifest import Manifest
    from services.experts.compute import ExpertCompute
    from services.experts.server import owned_experts
    from services.experts.servicer import ExpertWorkerServicer
    from services.experts.store_setup import open_store

    manifest = Manifest.load(split)
    owned = owned_experts(manifest, None, "2-5")
    store, budget = open_store(split, manifest, owned)
    servicer = ExpertWorkerServicer(ExpertCompute(store, max_call_bytes=CALL_CAP), "fuzz", budget)
    return servicer.answer, manifest.hidden_size, [2, 5]


def tiny_split(root: Path) -> Path:
    from services.tools.split import split_checkpoint
    from services.tools.synthetic_model import TINY_CONFIGS, build_random_checkpoint

    checkpoint, split = root / "qwen3_moe", root / "qwen3_moe-split"
    build_random_checkpoint(checkpoint, TINY_CONFIGS["qwen3_moe"], bits=None)
    split_checkpoint(checkpoint, split, progress=False)
    return split


def all_targets(root: Path) -> list[Target]:
    return targets_for_split(tiny_split(root))


def targets_for_split(split: Path) -> list[Target]:
    """Every target; the worker's two over layers' experts 2-5 of `split`."""
    answer, hidden_size, experts = worker_answer(split)
    call_seeds = expert_call_seeds(hidden_size, experts)
    return [
        expert_call_target(answer, call_seeds),
        frame_stream_target(answer, call_seeds),
        tensor_target(),
        manifest_target((split / "manifest.json").read_bytes()),
        *cluster_targets(),
        safetensors_target(),
        *mapper_targets(),
    ]


class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang()


def fuzz(target: Target, inputs: int, seconds: float | None, seed: int = 0) -> dict:
    """Feed `target` its seeds, then mutations, until `inputs` or `seconds` run out."""
    rng = random.Random(seed)
    corpus = list(target.seeds)
    outcomes: Counter = Counter()
    findings: list[dict] = []
    previous = signal.signal(signal.SIGALRM, _alarm)
    started = time.perf_counter()
    done = 0
    try:
        while done < inputs:
            if done < len(target.seeds):
                data = target.seeds[done]
            else:
                data = target.mutate(rng.choice(corpus), corpus, rng)[:MAX_INPUT_BYTES]
            signal.alarm(HANG_S)
            try:
                outcome = target.run(data)
            except Finding as finding:
                outcome = "finding"
                if len(findings) < 20:
                    findings.append({"error": str(finding)[:400], "input_hex": data[:512].hex()})
            except _Hang:
                outcome = "finding"
                findings.append({"error": f"no answer within {HANG_S} s", "input_hex": data[:512].hex()})
            finally:
                signal.alarm(0)
            outcomes[outcome] += 1
            if outcome == "accepted" and len(corpus) < CORPUS_LIMIT and data not in corpus:
                corpus.append(data)  # accepted variants reach deeper than the seeds alone
            done += 1
            if seconds is not None and done % 100 == 0 and time.perf_counter() - started > seconds:
                break
    finally:
        signal.signal(signal.SIGALRM, previous)
    elapsed = time.perf_counter() - started
    return {
        "inputs": done,
        "seconds": round(elapsed, 1),
        "inputs_per_s": round(done / elapsed) if elapsed else None,
        "accepted": outcomes["accepted"],
        "refused": outcomes["refused"],
        "findings": outcomes["finding"],
        "examples": findings,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--inputs", type=int, default=1_000_000, help="inputs per target")
    parser.add_argument("--seconds", type=float, default=None, help="time budget per target")
    parser.add_argument("--targets", default=None, help="comma-separated target names (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from services.common.logging import configure_logging

    configure_logging("fuzz", level="critical")  # each refusal logs a warning by design
    with tempfile.TemporaryDirectory(prefix="moe-mesh-fuzz-") as root:
        targets = all_targets(Path(root))
        wanted = set(args.targets.split(",")) if args.targets else {t.name for t in targets}
        unknown = wanted - {t.name for t in targets}
        if unknown:
            parser.error(f"unknown target(s) {', '.join(sorted(unknown))}")
        results = {}
        for target in targets:
            if target.name in wanted:
                results[target.name] = fuzz(target, args.inputs, args.seconds, args.seed)
                print(
                    json.dumps(
                        {target.name: {k: v for k, v in results[target.name].items() if k != "examples"}}
                    ),
                    file=sys.stderr,
                    flush=True,
                )
    print(
        json.dumps(
            {
                "bench": "fuzz",
                "machine": f"{platform.system()} {platform.machine()}",
                "command": "python bench/fuzz.py " + " ".join(sys.argv[1:]),
                "inputs_cap": args.inputs,
                "seconds_cap": args.seconds,
                "targets": results,
            },
            indent=1,
        )
    )
    sys.exit(1 if any(r["findings"] for r in results.values()) else 0)


if __name__ == "__main__":
    main()
