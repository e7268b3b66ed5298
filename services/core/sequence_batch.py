"""One batch's sequences at their three stages: waiting, being prefilled, decoding.

moe-mesh keeps this scheduling state itself; what it takes from mlx-lm is the two batch
classes that run the model over many sequences with one merged KV cache: `PromptProcessingBatch`
(prefill chunks of the prompts being prefilled) and `GenerationBatch` (one decode step of the
running sequences: forward, logits processors, sampling, stop matching, finished rows leaving).
`batch_step.BatchStep` plans and runs one engine step over this state.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from mlx_lm.generate import GenerationBatch, PromptProcessingBatch, StopSequences
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import greedy_sampler


@dataclass
class WaitingSequence:
    """An inserted sequence not yet admitted to prefill."""

    uid: int
    segments: list[list[int]]  # prompt token runs still to prefill; the last is the final token alone
    max_tokens: int
    cache: list  # its KV cache, holding the positions of `tokens`
    tokens: list[int]  # prompt positions the cache holds already (the prefix cache's hit)
    sampler: object
    logits_processors: tuple
    stop_sequences: StopSequences


@dataclass
class PrefillProgress:
    """A prefilling row's remaining segments, and its prompt tokens done and in all."""

    segments: list[list[int]]
    done: int
    total: int


class SequenceBatch:
    """The sequences of one batch. `max_decoding` bounds the decoding batch and
    `max_prefilling` the prompts prefilled at once; `prefill_chunk` is the longest prompt
    slice one step prefills per row. The engine's step budget sets all three before each step."""

    def __init__(self, model, max_sequences: int, prefill_chunk: int):
        self.model = model
        self.max_decoding = max_sequences
        self.max_prefilling = max_sequences
        self.waiting: deque[WaitingSequence] = deque()
        self.prefilling: list[PrefillProgress] = []  # one per row of `prompt_batch`
        self.prompt_batch = PromptProcessingBatch.empty(
            model, greedy_sampler, prefill_step_size=prefill_chunk
        )
        self.generation_batch = GenerationBatch.empty(model, greedy_sampler)
        self.decode_steps = 0
        self._next_uid = 0

    @property
    def prefill_chunk(self) -> int:
        return self.prompt_batch.prefill_step_size

    @prefill_chunk.setter
    def prefill_chunk(self, tokens: int) -> None:
        self.prompt_batch.prefill_step_size = tokens

    def insert(
        self,
        segments: list[list[int]],
        max_tokens: int,
        cache: list | None = None,
        tokens: list[int] | None = None,
        sampler=None,
        logits_processors=None,
        stop_sequences: StopSequences | None = None,
    ) -> int:
        """Queue a sequence whose prompt is `segments` (prefill stops at each segment's end, so
        its KV can be kept there); returns its uid. The prompt's last token becomes a segment of
        its own: its forward samples the first generated token."""
        segments = [segment for segment in segments if segment]
        if not segments:
            raise ValueError("the prompt is empty")
        if max_tokens <= 0:
            raise ValueError("max_tokens must be > 0")
        if len(segments[-1]) != 1:
            segments[-1], last = segments[-1][:-1], segments[-1][-1:]
            segments.append(last)
        uid, self._next_uid = self._next_uid, self._next_uid + 1
        self.waiting.append(
            WaitingSequence(
                uid,
                segments,
                max_tokens,
                make_prompt_cache(self.model) if cache is None else cache,
                list(tokens or []),
                sampler or greedy_sampler,
                tuple(logits_processors or ()),
                stop_sequences or StopSequences(),
            )
        )
        return uid

    def admit(self, n: int) -> None:
        """Move the next `n` waiting sequences into the prompt batch."""
        admitted = [self.waiting.popleft() for _ in range(n)]
        for sequence in admitted:
            total = sum(len(s) for s in sequence.segments)
            self.prefilling.append(PrefillProgress(sequence.segments, 0, total))
        self.prompt_batch.extend(
            PromptProcessingBatch(
                model=self.model,
                uids=[s.uid for s in admitted],
                caches=[s.cache for s in admitted],
                tokens=[s.tokens for s in admitted],
                prefill_step_size=self.prefill_chunk,
                samplers=[s.sampler for s in admitted],
                fallback_sampler=greedy_sampler,
                logits_processors=[s.logits_processors for s in admitted],
                stop_sequences=[s.stop_sequences for s in admitted],
                max_tokens=[s.max_tokens for s in admitted],
            )
        )

    def running(self) -> int:
        """Sequences decoding or being prefilled."""
        return len(self.generation_batch) + len(self.prompt_batch)

    def size(self) -> int:
        """Sequences running and waiting."""
        return self.running() + len(self.waiting)

    def extract_cache(self, uids) -> dict[int, tuple[list, list[int]]]:
        """uid -> (a copy of its KV cache, the tokens it holds), for the sequences in `uids`."""
        wanted, found = set(uids), {}
        for sequence in self.waiting:
            if sequence.uid in wanted:
                found[sequence.uid] = (sequence.cache, sequence.tokens)
        for stage in (self.prompt_batch, self.generation_batch):
            for row, uid in enumerate(stage.uids):
                if uid in wanted:
                    found[uid] = (stage.extract_cache(row), stage.tokens[row])
        return found

    def remove(self, uids, keep_caches: bool = False) -> dict[int, tuple[list, list[int]]]:
        """Take sequences out, wherever they are; with `keep_caches`, return theirs as
        `extract_cache` does."""
        kept = self.extract_cache(uids) if keep_caches else {}
        gone = set(uids)
        if any(s.uid in gone for s in self.waiting):
            self.waiting = deque(s for s in self.waiting if s.uid not in gone)
        rows = [row for row, uid in enumerate(self.prompt_batch.uids) if uid not in gone]
        if len(rows) < len(self.prompt_batch):
            self.prompt_batch.filter(rows)
            self.prefilling = [self.prefilling[row] for row in rows]
        rows = [row for row, uid in enumerate(self.generation_batch.uids) if uid not in gone]
        if len(rows) < len(self.generation_batch):
            self.generation_batch.filter(rows)
        return kept

    def kv_bytes(self) -> int:
        """Bytes of every KV cache in the batch, the waiting sequences' included."""
        total = sum(c.nbytes for s in self.waiting for c in s.cache)
        total += sum(c.nbytes for c in self.prompt_batch.prompt_cache)
        return total + sum(c.nbytes for c in self.generation_batch.prompt_cache)
