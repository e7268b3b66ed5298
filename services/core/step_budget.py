"""How one engine step shares its token budget between the batches it runs."""

from __future__ import annotations

from services.core.prefill_pacer import PrefillPacer
from services.core.sequence_batch import SequenceBatch


def share_step_budget(
    batches: list[SequenceBatch], max_num_seqs: int, max_num_batched_tokens: int, pacer: PrefillPacer
) -> tuple[int, int]:
    """Share the step's token budget across every batch of the step: decoding sequences take
    one token each, the sequences being prefilled split the rest. Counts admissions as
    `BatchStep._plan` makes them, so the chunks it cuts this step stay within budget.
    Returns the sequences decoding in the step and all it runs (decoding, prefilling and
    joining): a prompt counts as running from the step that starts its prefill, not from the
    end of that step, which on a slow machine is many seconds later."""
    decoding = sum(len(b.generation_batch) for b in batches)
    in_batches = sum(b.running() for b in batches)
    prefilling = {}
    for batch in batches:
        # --max-num-seqs bounds all batches together: this one may grow into what the others
        # leave free (it stops admitting prompts at its own size, never shrinks below it).
        own = batch.running()
        room = max(max_num_seqs - (in_batches - own), 0)
        batch.max_decoding = room
        # prompts being prefilled count against the same room as the decoding sequences
        batch.max_prefilling = max(room - len(batch.generation_batch), 0)
        joining = min(
            batch.max_prefilling - len(batch.prompt_batch),
            batch.max_decoding - len(batch.generation_batch),
            len(batch.waiting),
        )
        prefilling[batch] = len(batch.prompt_batch) + max(joining, 0)
        in_batches += max(joining, 0)  # the next batch's room leaves out who joins this one
    if sum(prefilling.values()):
        tokens = pacer.budget(max_num_batched_tokens - decoding, decoding)
        chunk = max(1, tokens // sum(prefilling.values()))
        for batch, count in prefilling.items():
            if count:
                batch.prefill_chunk = chunk
    return decoding, in_batches
