"""What an engine step produced, per sequence: each token, its logprobs and finish as the
GenerateChunk the client reads; prompt scores (prompt logprobs, score-only requests); and the KV
of finished prefills, kept for prefix reuse."""

from __future__ import annotations

import time
from collections.abc import Callable

import mlx.core as mx

from services.core.engine_config import EngineCounters
from services.core.logprobs import LogprobWriter
from services.core.prefix_cache import PrefixCache
from services.core.sequence import Sequence
from services.core.sequence_batch import SequenceBatch
from services.proto.moemesh.v1 import core_pb2

FINISH = {"stop": core_pb2.FinishReason.STOP, "length": core_pb2.FinishReason.LENGTH}


class SequenceOutput:
    """`finish_sequence(sequence, remove, keep_prefix=False)` takes a sequence out of its batch
    (the engine's `_finish`)."""

    def __init__(
        self,
        logprobs: LogprobWriter,
        counters: EngineCounters,
        prefix_cache: PrefixCache,
        finish_sequence: Callable[..., None],
        kept_cache: Callable[[tuple[str, int], int, int, list], list],
    ):
        """`kept_cache(batch, uid, positions, cache)`: a sequence's cache as the prefix cache keeps
        it (KindBatches.kept_cache)."""
        self.kept_cache = kept_cache
        self.logprobs = logprobs
        self.counters = counters
        self.prefix_cache = prefix_cache
        self._finish_sequence = finish_sequence

    def deliver(
        self, batch: tuple[str, int], sequences: SequenceBatch, step, outcome, active: dict, started: float
    ) -> None:
        """What one batch's step (batch_step.BatchStep) produced, for the sequences in
        `active` ((batch, uid) -> Sequence): prompt scores, finished prefills, decoded tokens."""
        prompt_responses, responses = outcome
        for uid, rows in step.prompt_logprobs.items():
            sequence = active.get((batch, uid))
            if sequence is not None:
                self.prompt_scores(sequence, rows)
        self._after_prefill(batch, sequences, prompt_responses, active, started)
        for response in responses:
            sequence = active.get((batch, response.uid))
            if sequence is not None:
                if sequence.prefill_started_at is None:
                    sequence.prefill_started_at = started
                self.token(sequence, response)

    def _after_prefill(self, batch, sequences: SequenceBatch, prompt_responses, active, started) -> None:
        """Note when each sequence's prefill began, and keep the KV of every prompt whose
        prefill just finished, so requests that share the prefix skip it."""
        finished = []
        for response in prompt_responses:
            sequence = active.get((batch, response.uid))
            if sequence is None:
                continue
            if sequence.prefill_started_at is None:
                sequence.prefill_started_at = started
            if response.end_of_segment and not response.end_of_prompt:
                finished.append(response.uid)
        if finished and self.prefix_cache.enabled:
            for uid, (cache, tokens) in sequences.extract_cache(finished).items():
                self.prefix_cache.store(batch[0], tokens[:], self.kept_cache(batch, uid, len(tokens), cache))

    def token(self, sequence: Sequence, response) -> None:
        """One generated token of `sequence` (mlx-lm's response), as its chunk."""
        request = sequence.request
        if request.score_only:  # a one-token prompt: never prefilled, so scored here
            self.score(sequence, retired=response.finish_reason is not None)
            return
        sequence.generated += 1
        self.counters.generation_tokens += 1
        if sequence.first_token_at is None:
            sequence.first_token_at = time.monotonic()
        chunk = core_pb2.GenerateChunk(request_id=request.request_id, token_ids=[response.token])
        if sequence.generated == 1:  # clients want the prompt's size up front (Anthropic's message_start)
            chunk.usage.prompt_tokens = len(request.prompt)
            chunk.usage.cached_prompt_tokens = sequence.cached_tokens
            chunk.prompt_logprobs.extend(sequence.prompt_logprobs)
            sequence.prompt_logprobs = []
        finish = FINISH.get(response.finish_reason) if response.finish_reason else None
        is_stop_token = response.finish_reason == "stop"
        if not is_stop_token:
            sequence.emitter.add(response.token).write_to(chunk)
        if request.logprobs:
            chunk.logprobs.append(
                self.logprobs.sampled(response.token, response.logprobs, request.top_logprobs)
            )
        if sequence.emitter.stopped and finish is None:
            finish = core_pb2.FinishReason.STOP
            self._finish_sequence(sequence, remove=True, keep_prefix=True)
        if finish is not None:
            sequence.emitter.finish().write_to(chunk)
            chunk.finish_reason = sequence.emitter.finish_reason(finish)
            fill_final(chunk, sequence)
            if not sequence.done:
                if response.prompt_cache is not None:
                    tokens, cache = response.all_tokens, response.prompt_cache
                    kept = self.kept_cache(sequence.batch, response.uid, len(tokens), cache)
                    self.prefix_cache.store(*sequence.prefix_entry(tokens), kept)
                self._finish_sequence(sequence, remove=False)
        sequence.send(chunk)

    def score(self, sequence: Sequence, retired: bool) -> None:
        """max_tokens 0 with prompt logprobs: the prompt, scored, is the whole answer, sent once the
        last prompt token is scored (the sequence then leaves its batch); `retired`: mlx-lm's
        batch has already let it go."""
        sequence.first_token_at = time.monotonic()
        chunk = core_pb2.GenerateChunk(request_id=sequence.request.request_id)
        chunk.prompt_logprobs.extend(sequence.prompt_logprobs)
        sequence.prompt_logprobs = []
        sequence.emitter.finish().write_to(chunk)  # the echoed prompt, if asked for
        chunk.finish_reason = core_pb2.FinishReason.LENGTH
        fill_final(chunk, sequence)
        if not sequence.done:
            self._finish_sequence(sequence, remove=not retired)
        sequence.send(chunk)

    def prompt_scores(self, sequence: Sequence, rows: mx.array) -> None:
        """Each row of a prefill chunk's logprobs scores the prompt token after that position."""
        scored = len(sequence.prompt_logprobs)
        targets = sequence.request.prompt[scored : scored + rows.shape[0]]
        if targets:
            top = sequence.request.top_logprobs
            sequence.prompt_logprobs += self.logprobs.scored(targets, rows[: len(targets)], top)
        if sequence.request.score_only and len(sequence.prompt_logprobs) == len(sequence.request.prompt):
            # scored in full: no need to compute the last token and the one after it
            self.score(sequence, retired=False)


def fill_final(chunk: core_pb2.GenerateChunk, sequence: Sequence) -> None:
    """The last chunk's usage and timings."""
    chunk.usage.prompt_tokens = len(sequence.request.prompt)
    chunk.usage.completion_tokens = sequence.generated
    chunk.usage.cached_prompt_tokens = sequence.cached_tokens
    prefill_started = sequence.prefill_started_at or sequence.submitted_at
    chunk.timings.queue_seconds = prefill_started - sequence.submitted_at
    chunk.timings.prefill_seconds = (sequence.first_token_at or prefill_started) - prefill_started
