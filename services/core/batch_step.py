"""One engine step of one `SequenceBatch`, split into its model forwards and its bookkeeping.

A step runs up to three forwards, laid out by `_plan`: the decode of the running sequences;
the last prompt token of every prompt fully prefilled, whose forward samples its first
token (those rows then join the decode batch); and the next chunk of every prompt still
being prefilled. The forwards come back as tasks, so the engine runs those of every batch
in the step side by side (`step_merge.run_side_by_side`) with one expert call per worker per
layer for all of them. They touch disjoint state: the decode runs on the generation batch,
the joining rows on a batch split off the prompt batch (joined to the generation batch only
in `finish`), the prefill chunk on what stays in the prompt batch.

This is the order mlx-lm's `BatchGenerator` steps in, so a request's tokens match mlx-lm's
server. Room for new prompts is judged before this step's decode, so a place freed by a
sequence finishing in this step is filled in the next one. A decode step of a batch with no
left padding runs without an attention mask (decode_mask.py), and rows that asked for prompt
logprobs keep their prefill logits (`logprobs.prefill_keeping_logprobs`), found in
`prompt_logprobs` after `finish`.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx_lm.generate import GenerationBatch, PromptProcessingBatch

from services.core.decode_mask import skip_decode_mask_if_unpadded
from services.core.logprobs import prefill_keeping_logprobs
from services.core.sequence_batch import SequenceBatch

# Decode steps between returns of MLX's buffer cache to the system (as mlx-lm's BatchGenerator does).
_CLEAR_CACHE_EVERY = 512


class BatchStep:
    """`tasks` run the step's forwards (in any interleaving); `finish(results)` takes their
    results in task order and returns (prompt_responses, generation_responses): mlx-lm's
    `PromptProcessingBatch.Response`s and `GenerationBatch.Response`s."""

    def __init__(
        self,
        batch: SequenceBatch,
        scoring: frozenset[int] = frozenset(),
        decode: Callable[[GenerationBatch], list] | None = None,
        prefill_sink: Callable[[list[int], list[list[int]]], None] | None = None,
    ):
        """`scoring`: uids of the sequences that want their prompt's logprobs; `decode`: runs the
        running batch's decode step (default `GenerationBatch.next`; speculative decoding's
        `SpeculativeDecoder.decode` verifies drafts in it). `prefill_sink(uids, tokens)` runs
        right after each prompt forward returns, while the hidden states it left are its own (MTP
        drafts from them): no forward switches in between its output head and its return."""
        self._decode = decode
        self._prefill_sink = prefill_sink
        self.batch = batch
        self.tasks: list[Callable[[], object]] = []
        self._decode_task: int | None = None
        self._joining_task: int | None = None
        self._prefill_task: int | None = None
        self._scored_rows: dict[int, int] = {}  # prefill row -> uid, for rows in `scoring`
        self.prompt_tokens = 0
        self.prompt_responses: list = []
        self.prompt_logprobs: dict[int, mx.array] = {}  # uid -> (chunk length, vocab) logprobs
        self._plan(scoring)

    def _add(self, task: Callable[[], object]) -> int:
        self.tasks.append(task)
        return len(self.tasks) - 1

    def _plan(self, scoring: frozenset[int]) -> None:
        batch = self.batch
        generation = batch.generation_batch
        if len(generation) > 0:
            skip_decode_mask_if_unpadded(generation.prompt_cache)
            decode = self._decode
            self._decode_task = self._add(generation.next if decode is None else lambda: decode(generation))
        # Busy enough with decoding: no prompt work this step.
        if len(generation) >= batch.max_decoding:
            return

        n = min(
            batch.max_prefilling - len(batch.prompt_batch),
            batch.max_decoding - len(generation),
            len(batch.waiting),
        )
        if n > 0:
            batch.admit(n)

        # Prompts with only their last token left move to generation: that token's forward
        # samples their first generated token.
        keep, split = [], []
        for row, progress in enumerate(batch.prefilling):
            segments = progress.segments
            (split if len(segments) == 1 and len(segments[0]) == 1 else keep).append(row)
        if split:
            last_inputs = [batch.prefilling[row].segments[0] for row in split]
            totals = [batch.prefilling[row].total for row in split]
            batch.prefilling = [batch.prefilling[row] for row in keep]
            joining = batch.prompt_batch.split(split)
            for uid, total in zip(joining.uids, totals, strict=True):
                self.prompt_responses.append(PromptProcessingBatch.Response(uid, (total, total), True, True))
            self._joining_task = self._add(
                self._sinking(lambda: joining.generate(last_inputs), list(joining.uids), last_inputs)
            )

        # The next chunk of every prompt still being prefilled.
        prompts = []
        for row, progress in enumerate(batch.prefilling):
            response = PromptProcessingBatch.Response(batch.prompt_batch.uids[row], 0, False, False)
            segments = progress.segments
            n = min(len(segments[0]), batch.prefill_chunk)
            prompts.append(segments[0][:n])
            segments[0] = segments[0][n:]
            if len(segments[0]) == 0:
                segments.pop(0)
                response.end_of_segment = True
            progress.done += len(prompts[-1])
            response.progress = (progress.done, progress.total)
            self.prompt_responses.append(response)
        if prompts:
            self.prompt_tokens = sum(len(p) for p in prompts)
            prompt_batch = batch.prompt_batch
            self._scored_rows = {i: uid for i, uid in enumerate(prompt_batch.uids) if uid in scoring}
            rows = set(self._scored_rows)
            self._prefill_task = self._add(
                self._sinking(
                    lambda: prefill_keeping_logprobs(prompt_batch, prompts, rows),
                    list(prompt_batch.uids),
                    prompts,
                )
            )

    def _sinking(self, forward: Callable[[], object], uids: list[int], tokens: list[list[int]]):
        """`forward`, handing its hidden states to the prefill sink right after it returns."""
        if self._prefill_sink is None:
            return forward

        def run():
            result = forward()
            self._prefill_sink(uids, tokens)
            return result

        return run

    def finish(self, results: list) -> tuple[list, list]:
        batch = self.batch
        generation_responses = []
        if self._decode_task is not None:
            generation_responses = results[self._decode_task]
            batch.decode_steps += 1
            if batch.decode_steps % _CLEAR_CACHE_EVERY == 0:
                mx.clear_cache()
        if self._joining_task is not None:
            batch.generation_batch.extend(results[self._joining_task])
        if self._prefill_task is not None:
            kept = results[self._prefill_task]
            self.prompt_logprobs = {uid: kept[row] for row, uid in self._scored_rows.items()}
        return self.prompt_responses, generation_responses
