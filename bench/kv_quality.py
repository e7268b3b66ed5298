"""TurboQuant quality on the demo model: perplexity table and greedy answers vs fp16.

    python bench/kv_quality.py                       # 4096 tokens of the bundled GPL-3 text
    python bench/kv_quality.py --tokens 1024 --model PATH --dtype float16

Perplexity: the text is prefilled chunk by chunk (tokens age into the compressed run
exactly as in serving) and scored token by token, for fp16 and each TurboQuant setting.
Greedy: a fixed set of long chat prompts (longer than sinks + window, so part of each
prompt is compressed) answered with fp16 and with each of --greedy-settings (default: the default setting).
Controls, answered the same way: mlx-lm's own quantized KV cache at 8 and 4 bits (`kv_bits`, group
64, from the first token): how far these answers move under a near-lossless and a common lossy cache
that is not TurboQuant. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import QuantizedKVCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.core.kv import KVCacheSettings, make_kv_cache
from services.core.kv import cache as kv_cache_module
from services.tools.kv_answers import (
    CONTEXT_CHARS,
    MORE_QUESTIONS,
    QUESTIONS,
    TEXT,
    departure,
    greedy_answer,
    is_near_tie,
    lead_shifts,
    prefill,
    question_prompts,
    shared_prefix_length,
)
from services.tools.kv_quality import load_bench_model, perplexity

CENTERED = dict(center_keys=True)  # keys quantized minus their mean (KVCacheSettings.center_keys)
PAPER = dict(key_bits=3, key_qjl=True)  # the K3+QJL keys (PAPER_SETTINGS)
MSE4 = dict(key_bits=4, key_qjl=False)  # the default's keys
SETTINGS = {  # at the default window (128 tokens) unless named; every row spells out its bits
    "K4/V3 (default)": KVCacheSettings(**MSE4, value_bits=3),
    "K3+QJL/V3 (paper)": KVCacheSettings(**PAPER, value_bits=3),
    "K3+QJL/V3, centered keys": KVCacheSettings(**PAPER, **CENTERED),
    "K3+QJL/V3, centered keys and values": KVCacheSettings(**PAPER, **CENTERED, center_values=True),
    "K4/V4": KVCacheSettings(**MSE4, value_bits=4),
    "K4/V4, centered keys": KVCacheSettings(**MSE4, value_bits=4, **CENTERED),
    "K2+QJL/V2": KVCacheSettings(key_bits=2, value_bits=2, key_qjl=True),
    "K3/V3": KVCacheSettings(key_bits=3, key_qjl=False),
    "K4+QJL/V4": KVCacheSettings(key_bits=4, value_bits=4, key_qjl=True),
    "K3+QJL/V3, window 384": KVCacheSettings(**PAPER, recent_window=384),
    "K3+QJL/V3, window 512": KVCacheSettings(**PAPER, recent_window=512),
    # control: TurboQuant's attention path with nothing compressed (every prompt fits the window),
    # so any answer that moves here moves through the path's arithmetic, not through compression
    "TurboQuant path, nothing compressed (control)": KVCacheSettings(recent_window=1 << 20),
}
# --windows: each of these bit settings at each recent window (the smallest window that keeps a
# setting under the 3 % bar is what the default window is chosen from)
WINDOW_GRID = {
    "K3+QJL/V3": PAPER,
    "K3+QJL/V3, centered keys": dict(**PAPER, **CENTERED),
    "K3/V3": dict(key_bits=3, key_qjl=False),
    "K4/V3": MSE4,
    "K4/V4": dict(**MSE4, value_bits=4),
    "K4+QJL/V4": dict(key_bits=4, value_bits=4, key_qjl=True),
    "K2+QJL/V2": dict(key_bits=2, value_bits=2, key_qjl=True),
}
MLX_LM_CONTROLS = {"mlx-lm 8-bit KV (control)": 8, "mlx-lm 4-bit KV (control)": 4}


def mlx_lm_kv(bits: int) -> dict:
    """generate_step's own quantized KV cache: `bits`, groups of 64, from the first token."""
    return dict(kv_bits=bits, kv_group_size=64, quantized_kv_start=0)


def shift_summary(pairs: list[tuple[float, float]]) -> dict:
    """Spread of the lead shifts over every answer token, and how many of fp16's decisions they
    overturn under teacher forcing (the shift larger than fp16's lead, against it)."""
    shifts = sorted(abs(shift) for shift, _ in pairs)
    rms = (sum(s * s for s in shifts) / len(shifts)) ** 0.5
    overturned = sum(lead + shift < 0 for shift, lead in pairs)
    return {
        "tokens": len(pairs),
        "rms": round(rms, 4),
        "p95_abs": round(shifts[int(0.95 * (len(shifts) - 1))], 4),
        "max_abs": round(shifts[-1], 4),
        "overturned": overturned,
    }


def shift_cache(model, name: str, prompt: list[int], shared: int, prefixes: dict, controls: dict):
    """(cache, tokens to feed it) for measuring `name`'s lead shifts on `prompt`."""
    if name in controls:  # mlx-lm's quantized cache from the first token, whole prompt
        return [QuantizedKVCache(group_size=64, bits=controls[name]) for _ in model.layers], prompt
    if name in prefixes:
        return prefixes[name], prompt[shared:]
    return make_kv_cache(model, "fp16"), prompt  # fp16 again, whole prompt: the numeric floor


def compare_answers(model, tokenizer, args, questions: list[str], controls: dict):
    """Greedy answers to `questions` under fp16 and each cache the flags name: the rows, the
    identical and identical-or-near-tie counts and (--lead-shifts) the (shift, fp16 lead) pairs.

    Each cache is prefilled with the prompts' common prefix once and copied for every question
    (prefix reuse, as core does); mlx-lm's quantized caches quantize on their own schedule
    inside generate_step, so they take whole prompts."""
    names = [*args.greedy_settings, *controls]
    answers, same, near = [], dict.fromkeys(names, 0), dict.fromkeys(names, 0)
    shifts = {name: [] for name in ["fp16 (numeric floor)", *names]} if args.lead_shifts and questions else {}
    if not questions:
        return answers, same, near, shifts
    prompts = question_prompts(tokenizer, questions, args.context_chars)
    shared = shared_prefix_length(prompts)
    prefixes = {"fp16": prefill(model, prompts[0][:shared], make_kv_cache(model, "fp16"))}
    for name in args.greedy_settings:
        caches = make_kv_cache(model, "turboquant", SETTINGS[name])
        prefixes[name] = prefill(model, prompts[0][:shared], caches)
    eos = tokenizer.eos_token_ids
    for question, prompt in zip(questions, prompts, strict=True):
        row = {"question": question, "prompt_tokens": len(prompt)}
        reference, logprobs = greedy_answer(model, prompt[shared:], prefixes["fp16"], args.answer_tokens, eos)
        row["fp16"], row["departures"], got = tokenizer.decode(reference, skip_special_tokens=True), {}, {}
        for name in list(shifts):
            cache, tokens = shift_cache(model, name, prompt, shared, prefixes, controls)
            try:
                pairs = lead_shifts(model, tokens, cache, reference, logprobs)
            except RuntimeError:  # MLX CUDA has no quantized attention for every head shape
                shifts.pop(name)
                continue
            shifts[name] += pairs
        for name in args.greedy_settings:
            got[name], _ = greedy_answer(model, prompt[shared:], prefixes[name], args.answer_tokens, eos)
        for name, bits in controls.items():
            try:
                got[name], _ = greedy_answer(
                    model, prompt, make_kv_cache(model, "fp16"), args.answer_tokens, eos, **mlx_lm_kv(bits)
                )
            except RuntimeError as error:
                row[name] = f"unavailable on this backend: {str(error)[:120]}"
                same.pop(name, None)
                near.pop(name, None)
        for name, answer in got.items():
            row[name] = tokenizer.decode(answer, skip_special_tokens=True)
            found = departure(reference, logprobs, answer)
            same[name] += found is None
            near[name] += is_near_tie(found)
            if found is not None:
                row["departures"][name] = found
        answers.append(row)
        print(json.dumps({"progress": question, **row}), file=sys.stderr, flush=True)
    return answers, same, near, shifts


def perplexity_rows(model, args) -> list:
    """(row name, cache maker) for the perplexity table the flags ask for."""
    if args.windows:
        return [
            (
                f"{name}, window {window}",
                lambda kw=kw, window=window: make_kv_cache(
                    model, "turboquant", KVCacheSettings(recent_window=window, **kw)
                ),
            )
            for window in args.windows
            for name, kw in WINDOW_GRID.items()
            if name in args.grid
        ]
    if args.layer_sweep:
        return [
            (
                f"{KVCacheSettings().describe()}, layer {layer} exact",
                lambda layer=layer: one_layer_exact(model, layer),
            )
            for layer in range(len(model.layers))
        ]

    if args.seed is None:
        return [
            (name, lambda name=name: make_kv_cache(model, "turboquant", SETTINGS[name]))
            for name in args.settings
        ]
    return [  # one row per setting and rotation seed, fp16's perplexity computed once for all
        (
            f"{name}, seed {seed}",
            lambda name=name, seed=seed: make_kv_cache(
                model, "turboquant", dataclasses.replace(SETTINGS[name], seed=seed)
            ),
        )
        for name in args.settings
        for seed in args.seed
    ]


def one_layer_exact(model, layer: int) -> list:
    """The default's caches, except that `layer` keeps mlx-lm's exact cache."""
    caches = make_kv_cache(model, "turboquant", KVCacheSettings())
    caches[layer] = make_kv_cache(model, "fp16")[layer]
    return caches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="mlx-lm checkpoint (default: the demo model's dense twin)"
    )
    parser.add_argument("--dtype", default=None, choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument(
        "--context-chars", type=int, default=CONTEXT_CHARS, help="license text before each question"
    )
    parser.add_argument("--answer-tokens", type=int, default=24)
    parser.add_argument(
        "--answers-only", action="store_true", help="greedy answers only (no perplexity table)"
    )
    parser.add_argument("--dequantize", action="store_true", help="float32 weights (fast on a CPU)")
    parser.add_argument(
        "--dense-kernel",
        action="store_true",
        help="quantized projections (and the head, every position) on core's CPU kernel (metal/linear_cpu.py)",
    )
    parser.add_argument(
        "--settings", nargs="*", choices=list(SETTINGS), default=list(SETTINGS), help="perplexity rows"
    )
    parser.add_argument("--perplexity-only", action="store_true", help="no greedy answers")
    parser.add_argument(
        "--lead-shifts",
        action="store_true",
        help="also: how far each cache moves fp16's lead along fp16's answers (teacher forcing)",
    )
    parser.add_argument("--no-controls", action="store_true", help="greedy answers without mlx-lm's caches")
    parser.add_argument(
        "--more-questions", action="store_true", help=f"{len(MORE_QUESTIONS)} more factual greedy prompts"
    )
    parser.add_argument(
        "--aging",
        choices=["device", "per-token", "deferred"],
        default="device",
        help="what a prefill chunk's queries see of the tokens the chunk compresses: as token by token"
        " (CPUs), or exact, the chunk aging after its attention (GPUs); default: this device's",
    )
    parser.add_argument(
        "--seed", type=int, nargs="+", default=None, help="rotation seeds of the --settings rows (a row each)"
    )
    parser.add_argument(
        "--windows",
        nargs="*",
        type=int,
        default=[],
        help="perplexity of each WINDOW_GRID setting at each of these recent windows (instead of --settings)",
    )
    parser.add_argument(
        "--grid", nargs="*", choices=list(WINDOW_GRID), default=list(WINDOW_GRID), help="--windows rows"
    )
    parser.add_argument(
        "--layer-sweep",
        action="store_true",
        help="perplexity of the default with one layer kept exact, for each layer in turn",
    )
    parser.add_argument(
        "--greedy-settings",
        nargs="*",
        choices=list(SETTINGS),
        default=["K4/V3 (default)"],
        help="settings whose greedy answers are compared with fp16",
    )
    args = parser.parse_args()
    if args.aging != "device":
        kv_cache_module.CHUNK_INVARIANT_PREFILL = args.aging == "per-token"
    aging = "per-token" if kv_cache_module.CHUNK_INVARIANT_PREFILL else "deferred"
    model, tokenizer, args.model = load_bench_model(args.model, args.dtype)
    if args.dequantize:
        from mlx_lm.utils import dequantize_model

        model = dequantize_model(model)
        model.set_dtype(mx.float32)
    if args.dense_kernel:
        from metal.linear_cpu import use_cpu_kernels

        if not use_cpu_kernels(model, heads_at_few_positions_only=False):
            raise SystemExit(
                "--dense-kernel: no projection moved (quantized weights and the C extension needed)"
            )

    ids = tokenizer.encode(TEXT.read_text())[: args.tokens + 1]
    if len(ids) < args.tokens + 1:
        raise SystemExit(f"the text has only {len(ids)} tokens")
    table = {}
    if not args.answers_only:
        table["fp16"] = round(perplexity(model, ids, make_kv_cache(model, "fp16")), 4)
        print(json.dumps({"progress": "fp16", "ppl": table["fp16"]}), file=sys.stderr, flush=True)
    for name, make in [] if args.answers_only else perplexity_rows(model, args):
        ppl = perplexity(model, ids, make())
        table[name] = {"ppl": round(ppl, 4), "increase_pct": round(100 * (ppl / table["fp16"] - 1), 2)}
        print(json.dumps({"progress": name, **table[name]}), file=sys.stderr, flush=True)

    questions = [] if args.perplexity_only else [*QUESTIONS, *(MORE_QUESTIONS if args.more_questions else ())]
    controls = {} if args.no_controls else MLX_LM_CONTROLS
    answers, same, near, shifts = compare_answers(model, tokenizer, args, questions, controls)
    print(
        json.dumps(
            {
                "bench": "kv_quality",
                "model": Path(args.model).name,
                "device": str(mx.default_device()),
                "tokens": args.tokens,
                "aging": aging,
                "perplexity": table,
                "greedy_identical": {name: f"{n}/{len(questions)}" for name, n in same.items()},
                # identical, or first departing where fp16 led by < NEAR_TIE_NATS (answers.py)
                "greedy_identical_or_near_tie": {name: f"{n}/{len(questions)}" for name, n in near.items()},
                "greedy": answers,
                **(
                    {"lead_shift_nats": {name: shift_summary(pairs) for name, pairs in shifts.items()}}
                    if shifts
                    else {}
                ),
            }
        )
    )


if __name__ == "__main__":
    main()
