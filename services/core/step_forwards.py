"""The model forwards of one engine step: every busy batch's, and an image prefill's, side by side.

Every forward of a lane (decode, prompts joining, prefill chunks, of every KV kind) shares one
expert call per worker per layer (step_merge.py); lanes pipeline theirs. What the forwards give
back is handed to each batch's `GeneratorStep.finish`, in task order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.generate import generation_stream

from services.core.batch_step import GeneratorStep
from services.core.engine_config import EngineConfig
from services.core.expert_link.step_merge import run_side_by_side
from services.core.image_prefills import ImagePrefills
from services.core.kind_batches import BatchKey, KindBatches
from services.core.prefill_pacer import PrefillPacer
from services.core.step_budget import share_step_budget


@dataclass
class StepForwards:
    steps: dict[BatchKey, GeneratorStep]
    outcomes: dict[BatchKey, tuple]  # what each step's `finish` returned
    tasks: int  # forwards run, the image prefill's included
    decoding: int  # sequences that decoded a token
    in_batch: int  # sequences decoding or being prefilled

    @property
    def prompt_tokens(self) -> int:
        """The prompt tokens really computed: a short prompt takes less than its chunk."""
        return sum(step.prompt_tokens for step in self.steps.values())


def run_step_forwards(
    batches: KindBatches,
    working: set[BatchKey],
    scoring: Callable[[BatchKey], frozenset[int]],
    image_prefills: ImagePrefills,
    config: EngineConfig,
    pacer: PrefillPacer,
) -> StepForwards:
    """Run the forwards of the batches in `working` (and of a pending image prefill)."""
    with mx.stream(generation_stream):
        busy = {batch: g for batch, g in batches.generators.items() if batch in working}
        decoding, in_batch = share_step_budget(
            list(busy.values()), config.max_num_seqs, config.max_num_batched_tokens, pacer
        )
        steps = {}
        for batch, generator in busy.items():
            decoder = batches.decoder(batch)
            decode, sink = (None, None) if decoder is None else (decoder.decode, decoder.prefill_sink)
            steps[batch] = GeneratorStep(generator, scoring(batch), decode, sink)
        tasks = [task for step in steps.values() for task in step.tasks]
        lanes = [batch[1] for batch, step in steps.items() for _ in step.tasks]
        image_task = image_prefills.task(config.max_num_batched_tokens - decoding)
        tasks, lanes = (tasks + [image_task], lanes + [0]) if image_task else (tasks, lanes)
        results = run_side_by_side(tasks, lanes)
        outcomes, start = {}, 0
        for batch, step in steps.items():
            outcomes[batch] = step.finish(results[start : start + len(step.tasks)])
            start += len(step.tasks)
    return StepForwards(steps, outcomes, len(tasks), decoding, in_batch)
