"""How one engine step shares its token budget between the batches it runs."""

from __future__ import annotations

from mlx_lm.generate import BatchGenerator

from services.common.mlx_lm_adapter import GeneratorState
from services.core.prefill_pacer import PrefillPacer


def share_step_budget(
    generators: list[BatchGenerator], max_num_seqs: int, max_num_batched_tokens: int, pacer: PrefillPacer
) -> tuple[int, int]:
    """Share the step's token budget across every batch of the step: decoding sequences take
    one token each, the sequences being prefilled split the rest. Mirrors how
    `BatchGenerator._next` admits prompts, so the chunks it cuts this step stay within budget.
    Returns the sequences decoding in the step and all it runs (decoding, prefilling and
    joining): a prompt counts as running from the step that starts its prefill, not from the
    end of that step, which on a slow machine is many seconds later."""
    states = {generator: GeneratorState(generator) for generator in generators}
    decoding = sum(len(s.generation_batch) for s in states.values())
    in_batches = sum(len(s.generation_batch) + len(s.prompt_batch) for s in states.values())
    prefilling = {}
    for generator, state in states.items():
        # --max-num-seqs bounds all batches together: this one may grow into what the others
        # leave free (it stops admitting prompts at its own size, never shrinks below it).
        own = len(state.generation_batch) + len(state.prompt_batch)
        room = max(max_num_seqs - (in_batches - own), 0)
        generator.completion_batch_size = room
        # mlx-lm admits up to completion_batch_size decoding *plus* prefill_batch_size prompts;
        # here prompts being prefilled count against the same room as the decoding sequences
        generator.prefill_batch_size = max(room - len(state.generation_batch), 0)
        joining = min(
            generator.prefill_batch_size - len(state.prompt_batch),
            generator.completion_batch_size - len(state.generation_batch),
            len(state.waiting),
        )
        prefilling[generator] = len(state.prompt_batch) + max(joining, 0)
        in_batches += max(joining, 0)  # the next batch's room leaves out who joins this one
    if sum(prefilling.values()):
        tokens = pacer.budget(max_num_batched_tokens - decoding, decoding)
        chunk = max(1, tokens // sum(prefilling.values()))
        for generator, count in prefilling.items():
            if count:
                generator.prefill_step_size = chunk
                states[generator].prompt_batch.prefill_step_size = chunk
    return decoding, in_batches
