"""How many sequences each batch may admit in a step (`step_budget.share_step_budget`):
--max-num-seqs bounds decoding and prefilling sequences of every KV cache kind together."""

from __future__ import annotations

from collections import deque

import pytest

from services.core.prefill_pacer import PrefillPacer
from services.core.step_budget import share_step_budget


class Batches:
    """The parts of a SequenceBatch that admission reads and sets."""

    def __init__(self, decoding: int, prefilling: int, queued: int):
        self.generation_batch = [object()] * decoding
        self.prompt_batch = [object()] * prefilling
        self.waiting = deque([object()] * queued)
        self.max_decoding = self.max_prefilling = self.prefill_chunk = 0

    def running(self) -> int:
        return len(self.generation_batch) + len(self.prompt_batch)

    def admitted(self) -> int:
        """What `BatchStep._plan` admits from the queue with these sizes."""
        if len(self.generation_batch) >= self.max_decoding:
            return 0
        n = min(
            self.max_prefilling - len(self.prompt_batch),
            self.max_decoding - len(self.generation_batch),
            len(self.waiting),
        )
        return max(n, 0)


@pytest.mark.parametrize(
    "batches",
    [
        [(1, 1, 5)],  # one decoding, one prefilling: room for 2 more of 4
        [(3, 0, 5)],
        [(1, 1, 5), (0, 0, 5)],  # two KV cache kinds: the second sees what the first admits
        [(2, 0, 5), (0, 1, 5)],
    ],
)
def test_decoding_and_prefilling_sequences_of_every_kind_share_max_num_seqs(batches):
    generators = [Batches(*shape) for shape in batches]
    share_step_budget(generators, max_num_seqs=4, max_num_batched_tokens=512, pacer=PrefillPacer(0.0))
    in_batches = sum(g.running() for g in generators)
    assert in_batches + sum(g.admitted() for g in generators) == 4
