"""The oracle: moe-mesh's split model, its experts on real worker processes, computes what
mlx-lm computes on the original checkpoint — same greedy tokens, same logits."""

from __future__ import annotations

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step

from metal import linear_cpu
from services.core.model_loader import load_core_model
from tests.helpers import linked_dispatcher

pytestmark = pytest.mark.slow  # starts processes or computes for seconds

PROMPT = "The quick brown fox jumps over the lazy dog because"
STEPS = 32


def greedy(model, prompt_tokens: mx.array, steps: int) -> list[int]:
    tokens = []
    for token, _ in generate_step(prompt_tokens, model, max_tokens=steps):
        tokens.append(int(token))
    return tokens


@pytest.mark.parametrize("bits", [None, 4], ids=["float32", "4bit"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe", "mixtral"])
@pytest.mark.parametrize("ranges", [["all"], ["0-2", "3-5", "6-7"]], ids=["1worker", "3workers"])
def test_split_model_matches_mlx_lm(tiny_models, short_tmp, arch, bits, ranges):
    source = tiny_models.checkpoint(arch, bits)
    split = tiny_models.split(arch, bits)
    reference, tokenizer = mlx_lm.load(str(source))
    prompt = mx.array(tokenizer.encode(PROMPT))

    with linked_dispatcher(split, short_tmp, ranges) as (_, dispatcher, manifest):
        core, on_kernel = load_core_model(split, manifest, dispatcher)
        # 4-bit: the core's projections run in metal/linear_cpu.py (this CPU), with the experts
        assert (on_kernel > 0) == (bits is not None and linear_cpu.available())

        want = reference(prompt[None])[0, -1]
        got = core(prompt[None])[0, -1]
        relative = (mx.abs(got - want).max() / mx.abs(want).max()).item()
        assert relative < 1e-4, f"last-position logits differ by {relative:.2e} relative"

        assert greedy(core, prompt, STEPS) == greedy(reference, prompt, STEPS)
        # every MoE layer went through the workers: prefill + (STEPS - 1) decode steps, twice
        assert len(dispatcher.timings) >= len(manifest.layers) * STEPS
