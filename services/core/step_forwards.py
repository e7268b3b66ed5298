"""The model forwards of one engine step: every busy batch's, and an image prefill's, side by side.

Every forward of a lane (decode, prompts joining, prefill chunks, of every KV kind) shares one
expert call per worker per layer (step_merge.py); lanes pipeline theirs. What the forwards give
back is handed to each batch's `BatchStep.finish`, in task order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.generate import generation_stream

from services.core.batch_step import BatchStep
from services.core.engine_config import EngineConfig
from services.core.expert_link.step_merge import run_side_by_side
from services.core.image_prefills import ImagePrefills
from services.core.kind_batches import BatchKey, KindBatches
from services.core.prefill_pacer import PrefillPacer
from services.core.step_budget import share_step_budget


@dataclass
class StepPlan:
    steps: dict[BatchKey, BatchStep]
    decoding: int  # sequences that decode a token in this step
    in_batch: int  # sequences decoding or being prefilled, this step's admissions included

    @property
    def prompt_tokens(self) -> int:
        """The prompt tokens really computed (once run): a short prompt takes less than its chunk."""
        return sum(step.prompt_tokens for step in self.steps.values())


@dataclass
class StepForwards:
    outcomes: dict[BatchKey, tuple]  # what each step's `finish` returned
    tasks: int  # forwards run, the image prefill's included


def plan_step(
    batches: KindBatches,
    working: set[BatchKey],
    scoring: Callable[[BatchKey], frozenset[int]],
    config: EngineConfig,
    pacer: PrefillPacer,
) -> StepPlan:
    """Share the step's budget among the batches in `working` and lay out each one's forwards."""
    with mx.stream(generation_stream):
        busy = {key: batch for key, batch in batches.by_key.items() if key in working}
        decoding, in_batch = share_step_budget(
            list(busy.values()), config.max_num_seqs, config.max_num_batched_tokens, pacer
        )
        steps = {}
        for key, batch in busy.items():
            decoder = batches.decoder(key)
            decode, sink = (None, None) if decoder is None else (decoder.decode, decoder.prefill_sink)
            steps[key] = BatchStep(batch, scoring(key), decode, sink)
    return StepPlan(steps, decoding, in_batch)


def run_step_forwards(plan: StepPlan, image_prefills: ImagePrefills, config: EngineConfig) -> StepForwards:
    """Run the planned forwards, and a pending image prefill's, side by side."""
    with mx.stream(generation_stream):
        steps = plan.steps
        tasks = [task for step in steps.values() for task in step.tasks]
        lanes = [batch[1] for batch, step in steps.items() for _ in step.tasks]
        image_task = image_prefills.task(config.max_num_batched_tokens - plan.decoding)
        tasks, lanes = (tasks + [image_task], lanes + [0]) if image_task else (tasks, lanes)
        results = run_side_by_side(tasks, lanes)
        outcomes, start = {}, 0
        for batch, step in steps.items():
            outcomes[batch] = step.finish(results[start : start + len(step.tasks)])
            start += len(step.tasks)
    return StepForwards(outcomes, len(tasks))
