"""Logits and greedy tokens against mlx-lm on the original checkpoint, with the experts spread
over three real worker processes: deepseek_v3 (MLA, shared expert, a dense first layer), gpt_oss
(experts under `experts`, biased SwitchGLU with its own activation), nemotron_h with a latent expert
width, and a checkpoint whose norms stay float32 beside bf16 weights (its hidden states reach the
experts in float32, as in mlx-lm).
"""

from __future__ import annotations

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step

from services.core.model_loader import load_core_model
from tests.helpers import linked_dispatcher

pytestmark = pytest.mark.slow  # starts processes or computes for seconds

# Every family's greedy tokens under `up` are tests/e2e/test_every_family.py's; these add the
# logits and the variants no family's tiny config has (latent expert width, float32 norms).
CASES = [
    ("deepseek_v3", 4, None),
    ("gpt_oss", 4, None),
    ("nemotron_h_latent", None, None),
    ("qwen3_moe", 4, "bf16-f32-norms"),
]


@pytest.mark.parametrize("arch, bits, dtypes", CASES, ids=[a + (f"-{d}" if d else "") for a, _, d in CASES])
def test_split_model_matches_mlx_lm(tiny_models, short_tmp, arch, bits, dtypes):
    reference, _ = mlx_lm.load(str(tiny_models.checkpoint(arch, bits, dtypes)))
    split = tiny_models.split(arch, bits, dtypes)
    prompt = mx.array(list(range(1000, 1016)))
    with linked_dispatcher(split, short_tmp, ["0-2", "3-5", "6-7"]) as (_, dispatcher, manifest):
        core, _ = load_core_model(split, manifest, dispatcher)
        want, got = reference(prompt[None])[0, -1], core(prompt[None])[0, -1]
        assert (mx.abs(got - want).max() / mx.abs(want).max()).item() < 1e-4

        def greedy(model):
            return [int(t) for t, _ in generate_step(prompt, model, max_tokens=16)]

        assert greedy(core) == greedy(reference)
