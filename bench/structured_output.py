"""Per-token cost of constrained decoding on the real Qwen3 vocabulary (151,936 logits).

    python bench/structured_output.py [--tokens 200] [--rounds 3] [--e2e-tokens 48]

Runs core's `GrammarConstraint` (llguidance) the way the engine calls it, once per
generated token: feed the last token, compute the allowed-token mask, set the rest of
the [1, V] logits to -1e30, then sample. The constraint's time (grammar + apply) is what a
constrained request pays per token on top of an unconstrained one; sampling is timed in
the same loop for scale. Sampling is at temperature 1 over random logits, so the grammar
walks many different paths.

With --e2e-tokens N (0 skips it) it also runs the tiny random qwen3_moe (the same
151,936-token vocabulary and lm_head) as real worker and core processes and measures
decode ms per token through `Core.Generate` with and without a JSON Schema constraint,
interleaved in the same run; that difference includes what the constraint costs the
engine beyond the mask (it must know each sampled token before the next step).
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mlx_lm.tokenizer_utils import load

from bench.workdir import bench_workdir
from services.core.structured_output import (
    GrammarConstraint,
    GrammarTokenizer,
    apply_mask,
    marker_term,
    response_format_grammar,
    tool_call_grammar,
)
from services.proto.moemesh.v1 import core_pb2
from services.tools.synthetic_model import qwen3_tokenizer_dir

VOCAB = 151936
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "email", "tags", "address"],
}


def grammars(tokenizer, vocabulary) -> dict[str, str]:
    def response_format(kind, schema=None):
        return response_format_grammar(
            core_pb2.ResponseFormat(type=kind, schema_json=json.dumps(schema) if schema else "")
        )

    weather = {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    }
    start = marker_term(tokenizer.tool_call_start, tokenizer.tool_call_start_tokens, vocabulary)
    end = marker_term(tokenizer.tool_call_end, tokenizer.tool_call_end_tokens, vocabulary)
    return {
        "json_object": response_format(core_pb2.ResponseFormat.JSON_OBJECT),
        "json_schema_person": response_format(core_pb2.ResponseFormat.JSON_SCHEMA, PERSON),
        "tool_call_required": tool_call_grammar(
            [weather, {"name": "get_time", "parameters": {}}], start, end, False
        ),
    }


def run(vocabulary, grammar: str, tokens: int, seed: int, eos: set[int]) -> dict:
    """One constrained generation of `tokens` tokens (the grammar restarts when an output ends).

    Per token, in ms: `grammar` = feeding the last token + computing the allowed-token mask
    (llguidance, plus unpacking its bits); `apply` = pushing the disallowed logits to -1e30,
    evaluated; `sample` = drawing the token (what every request pays anyway, for scale)."""
    rng = np.random.default_rng(seed)
    logits_bank = [mx.array(rng.standard_normal((1, VOCAB)).astype(np.float32) * 4) for _ in range(16)]
    mx.eval(logits_bank)
    key = mx.random.key(seed)
    constraint = GrammarConstraint(vocabulary, grammar)
    context, completed = [0], 0
    parts = {"grammar": [], "apply": [], "sample": []}
    for step in range(tokens):
        logits = logits_bank[step % len(logits_bank)]
        t0 = time.perf_counter()
        if len(context) > 1:
            constraint._consume(context[-1:])
        allowed = constraint.allowed()
        t1 = time.perf_counter()
        masked = apply_mask(logits, allowed)
        mx.eval(masked)
        t2 = time.perf_counter()
        key, subkey = mx.random.split(key)
        token = int(mx.random.categorical(masked, key=subkey).item())
        t3 = time.perf_counter()
        parts["grammar"].append((t1 - t0) * 1000)
        parts["apply"].append((t2 - t1) * 1000)
        parts["sample"].append((t3 - t2) * 1000)
        if token in eos:
            completed += 1
            constraint, context = GrammarConstraint(vocabulary, grammar), [0]
            continue
        context.append(token)
    parts["completed"] = completed
    return parts


def e2e(tokens: int, rounds: int) -> dict:
    """Decode ms/token through a real core: unconstrained vs constrained, interleaved."""

    import grpc

    from services.proto.moemesh.v1 import core_pb2_grpc
    from services.tools.split import split_checkpoint
    from services.tools.synthetic_model import TINY_CONFIGS, build_random_checkpoint
    from tests.helpers import Workers, spawn, stop, wait_serving

    workdir = bench_workdir("mm-bench-")
    build_random_checkpoint(workdir / "ckpt", TINY_CONFIGS["qwen3_moe"], bits=None)
    split_checkpoint(workdir / "ckpt", workdir / "split", progress=False)
    workers = Workers(workdir / "split", workdir, ["0-7"]).start()
    address = f"unix:{workdir / 'core.sock'}"
    core = spawn(
        ["core", "--split", str(workdir / "split"), "--listen", address, "--worker", workers.addresses[0]],
        workdir / "core.log",
    )
    # One long string: the random model stays inside it, so both runs decode `tokens` tokens.
    schema = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}
    try:
        wait_serving(address, core, timeout_s=300, log_path=workdir / "core.log")
        with grpc.insecure_channel(address) as channel:
            stub = core_pb2_grpc.CoreStub(channel)

            def decode_ms(constrained: bool) -> float:
                request = core_pb2.GenerateRequest(
                    prompt="Tell a story as JSON.",
                    sampling=core_pb2.SamplingParams(temperature=0),
                    stopping=core_pb2.StoppingCriteria(max_tokens=tokens),
                )
                if constrained:
                    request.response_format.type = core_pb2.ResponseFormat.JSON_SCHEMA
                    request.response_format.schema_json = json.dumps(schema)
                stamps = [time.perf_counter() for _ in stub.Generate(request, timeout=600)]
                return (stamps[-1] - stamps[0]) * 1000 / (len(stamps) - 1)

            decode_ms(True)  # warm-up: builds the grammar vocabulary once
            decode_ms(False)
            free, constrained = [], []
            for _ in range(rounds):
                free.append(decode_ms(False))
                constrained.append(decode_ms(True))
    finally:
        stop([core])
        workers.stop()
    free_ms, constrained_ms = min(free), min(constrained)
    return {
        "model": "tiny qwen3_moe (random, float32), 1 worker",
        "tokens": tokens,
        "unconstrained_ms_per_token": round(free_ms, 2),
        "json_schema_ms_per_token": round(constrained_ms, 2),
        "constrained_over_unconstrained": round(constrained_ms / free_ms, 3),
    }


def summary(samples: list[float]) -> dict:
    p50, p99 = np.percentile(np.array(samples), [50, 99])
    return {
        "p50_ms": round(float(p50), 3),
        "p99_ms": round(float(p99), 3),
        "mean_ms": round(float(np.mean(samples)), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--e2e-tokens", type=int, default=48)
    args = parser.parse_args()

    tokenizer = load(qwen3_tokenizer_dir())
    started = time.perf_counter()
    vocabulary = GrammarTokenizer(tokenizer, VOCAB).get()
    build_s = time.perf_counter() - started
    eos = set(tokenizer.eos_token_ids)
    result = {
        "vocab_size": VOCAB,
        "tokens_per_round": args.tokens,
        "rounds": args.rounds,
        "vocabulary_build_s": round(build_s, 2),
        "grammars": {},
    }
    for name, grammar in grammars(tokenizer, vocabulary).items():
        parts = {"grammar": [], "apply": [], "sample": []}
        outputs = 0
        for round_ in range(args.rounds):
            measured = run(vocabulary, grammar, args.tokens, seed=round_, eos=eos)
            outputs += measured.pop("completed")
            for part, samples in measured.items():
                parts[part] += samples
        total = [g + a for g, a in zip(parts["grammar"], parts["apply"], strict=True)]
        result["grammars"][name] = {
            "constraint_per_token": summary(total),
            **{part: summary(samples) for part, samples in parts.items()},
            "constraint_over_sampling_p50": round(
                float(np.median(total)) / float(np.median(parts["sample"])), 3
            ),
            "completed_outputs": outputs,
        }
    if args.e2e_tokens:
        result["e2e"] = e2e(args.e2e_tokens, args.rounds)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
