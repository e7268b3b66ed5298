"""One engine step of one `BatchGenerator`, split into its model forwards and its bookkeeping.

This mirrors mlx-lm 0.32's `BatchGenerator._next` (pinned in pyproject) line for line,
with one change: instead of running its forwards one after another, it hands them back
as tasks, so the engine can run the forwards of every batch in the step side by side
(`step_merge.run_side_by_side`) and make one expert call per worker per layer for all of
them. The forwards of one generator touch disjoint state: the decode runs on the
generation batch, the first token of finished prompts on a batch split off the prompt
batch (joined to the generation batch only in `finish`), the prefill chunk on what stays
in the prompt batch.

Two additions: a decode step of a batch with no left padding runs without an attention mask
(decode_mask.py), and rows that asked for prompt logprobs keep their prefill logits
(`logprobs.prefill_keeping_logprobs`), found in `prompt_logprobs` after `finish`.

One difference from `_next`: whether the running batch has room for new prompts is
judged before this step's decode rather than after it, so a place freed by a sequence
finishing in this step is filled in the next step (one step later than mlx-lm would).
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch

from services.common.mlx_lm_adapter import GeneratorState
from services.core.decode_mask import skip_decode_mask_if_unpadded
from services.core.logprobs import prefill_keeping_logprobs


class GeneratorStep:
    """`tasks` run the step's forwards (in any interleaving); `finish(results)` takes their
    results in task order and returns what `_next` returns: (prompt_responses,
    generation_responses)."""

    def __init__(
        self,
        generator: BatchGenerator,
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
        self.generator = generator
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
        gen, state = self.generator, GeneratorState(self.generator)
        generation = state.generation_batch
        if len(generation) > 0:
            skip_decode_mask_if_unpadded(generation.prompt_cache)
            decode = self._decode
            self._decode_task = self._add(generation.next if decode is None else lambda: decode(generation))
        # Busy enough with decoding: no prompt work this step.
        if len(generation) >= gen.completion_batch_size:
            return

        n = min(
            gen.prefill_batch_size - len(state.prompt_batch),
            gen.completion_batch_size - len(generation),
            len(state.waiting),
        )
        if n > 0:
            state.prompt_batch.extend(state.admit(n))

        # Prompts with only their last token left move to generation: that token's forward
        # samples their first generated token.
        keep, split = [], []
        for i, seq in enumerate(state.processing):
            segments = seq[0]
            (split if len(segments) == 1 and len(segments[0]) == 1 else keep).append(i)
        if split:
            last_inputs = [state.processing[i][0][0] for i in split]
            progress = [(state.processing[i][2],) * 2 for i in split]
            state.processing = [state.processing[i] for i in keep]
            joining = state.prompt_batch.split(split)
            for uid, p in zip(joining.uids, progress, strict=True):
                self.prompt_responses.append(PromptProcessingBatch.Response(uid, p, True, True))
            self._joining_task = self._add(
                self._sinking(lambda: joining.generate(last_inputs), list(joining.uids), last_inputs)
            )

        # The next chunk of every prompt still being prefilled.
        prompts = []
        for i, seq in enumerate(state.processing):
            response = PromptProcessingBatch.Response(state.prompt_batch.uids[i], 0, False, False)
            segments = seq[0]
            n = min(len(segments[0]), gen.prefill_step_size)
            prompts.append(segments[0][:n])
            segments[0] = segments[0][n:]
            if len(segments[0]) == 0:
                segments.pop(0)
                response.end_of_segment = True
            seq[1] += len(prompts[-1])
            response.progress = (seq[1], seq[2])
            self.prompt_responses.append(response)
        if prompts:
            self.prompt_tokens = sum(len(p) for p in prompts)
            prompt_batch = state.prompt_batch
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
        state = GeneratorState(self.generator)
        generation_responses = []
        if self._decode_task is not None:
            generation_responses = results[self._decode_task]
            state.counters.generation_tokens += len(generation_responses)
            state.counters.generation_steps += 1
            if state.counters.generation_steps % 512 == 0:
                mx.clear_cache()
        if self._joining_task is not None:
            state.generation_batch.extend(results[self._joining_task])
        state.counters.prompt_tokens += self.prompt_tokens
        if self._prefill_task is not None:
            kept = results[self._prefill_task]
            self.prompt_logprobs = {uid: kept[row] for row, uid in self._scored_rows.items()}
        return self.prompt_responses, generation_responses
