"""The engine's running batches: one `SequenceBatch` per KV cache kind and micro-batch,
and its `SpeculativeDecoder` when core speculates.

A batch's caches merge into one batched cache, so kinds cannot share a batch; their forwards still
share each step's expert calls (step_merge). With `--micro-batches 2` every kind runs in two
batches (lanes) and a new sequence joins the smaller one: the engine step then pipelines the
lanes' expert calls (one lane's attention runs while the other's experts compute). A batch is
named by its key, (kind, lane). Everything here runs on the engine thread.
"""

from __future__ import annotations

from collections.abc import Callable

from mlx_lm.utils import maybe_set_recommended_wired_limit

from services.core.engine_config import EngineConfig
from services.core.kv import make_kv_cache
from services.core.sequence_batch import SequenceBatch
from services.core.speculative import SpeculativeDecoder, make_drafter
from services.core.speculative.policy import StepCosts
from services.core.speculative.recurrent_rows import recurrent_rows

BatchKey = tuple[str, int]  # (KV cache kind, micro-batch lane)


class KindBatches:
    def __init__(self, config: EngineConfig, counters, speculates: Callable[[str, int], bool]):
        """`speculates(batch, uid)`: whether that sequence's request allows drafts."""
        self.config = config
        self._counters = counters
        self._speculates = speculates
        self.model = None
        self._drafter = None  # what drafts tokens, made once the model is loaded
        self._recurrent = None  # the model's recurrent layers, replayed after each verify
        self.by_key: dict[BatchKey, SequenceBatch] = {}
        self._decoders: dict[BatchKey, SpeculativeDecoder] = {}
        self._step_costs: dict[BatchKey, StepCosts] = {}  # outlive the batches: learned once

    def use_model(self, model, tokenizer) -> None:
        self.model = model
        maybe_set_recommended_wired_limit()  # on Metal: keep the weights wired, as mlx-lm does
        if self.config.speculative is not None:
            self._recurrent = recurrent_rows(model)  # refuses caches that cannot drop tokens
            self._drafter = make_drafter(self.config.speculative, tokenizer, model)

    def new_cache(self, kind: str) -> list:
        return make_kv_cache(self.model, kind, self.config.kv_settings)

    def place(self, kind: str) -> BatchKey:
        """The batch a new sequence of `kind` joins: the lane with the fewest sequences."""
        return min(((kind, lane) for lane in range(self.config.micro_batches)), key=self._size)

    def _size(self, batch: BatchKey) -> int:
        sequences = self.by_key.get(batch)
        return 0 if sequences is None else sequences.size()

    def batch(self, batch: BatchKey) -> SequenceBatch:
        if batch not in self.by_key:
            self.by_key[batch] = SequenceBatch(
                self.model, self.config.max_num_seqs, self.config.max_num_batched_tokens
            )
        return self.by_key[batch]

    def decoder(self, batch: BatchKey) -> SpeculativeDecoder | None:
        if self.config.speculative is None:
            return None
        if batch not in self._decoders:
            costs = self._step_costs.setdefault(batch, StepCosts(self.config.speculative.draft_cost))
            costs.idle()  # a new batch: the last mark of the one before ends nothing
            self._decoders[batch] = SpeculativeDecoder(
                self.config.speculative,
                self._counters.speculative,
                lambda uid: self._speculates(batch, uid),
                self._drafter,
                costs,
                self._recurrent,
            )
        return self._decoders[batch]

    def resumes_drafts(self) -> bool:
        """Whether the drafter (MTP) keeps per-sequence state that the prefix cache carries."""
        return getattr(self._drafter, "wants_hidden", False)

    def started(self, batch: BatchKey, uid: int, cached: int, kept=None) -> None:
        """A sequence joined `batch` with `cached` prompt positions from the prefix cache, and the
        MTP state kept with them (speculative/mtp_prefix.py)."""
        decoder = self.decoder(batch)
        if decoder is not None:
            decoder.start(uid, cached, kept)

    def kept_cache(self, batch: BatchKey, uid: int, positions: int, cache: list) -> list:
        """`cache`, a sequence's KV of its first `positions` tokens, as the prefix cache keeps it:
        with the MTP layer's state over them at its end, where the sequence drafts with MTP."""
        decoder = self._decoders.get(batch)
        kept = None if decoder is None else decoder.kept(uid, positions)
        return cache if kept is None else [*cache, kept]

    def finished(
        self, batch: BatchKey, uid: int, remove: bool = False, keep_prompt_cache: bool = False
    ) -> list[tuple[list[int], list]]:
        """A sequence left its batch: its drafting state goes too (an MTP cache, a draft model's).
        With `remove` its KV cache is freed now, and with `keep_prompt_cache` returned as `_remove`
        returns it."""
        kept = self._remove(batch, uid, keep_prompt_cache) if remove else []
        decoder = self._decoders.get(batch)
        if decoder is not None:
            decoder.forget(uid)
        return kept

    def _remove(self, batch: BatchKey, uid: int, keep_prompt_cache: bool) -> list[tuple[list[int], list]]:
        """Take a sequence out of its batch, freeing its KV cache; with `keep_prompt_cache`, its
        (tokens, cache) in token order (speculation may have moved its slots)."""
        caches = self.by_key[batch].remove([uid], keep_caches=keep_prompt_cache)
        decoder = self._decoders.get(batch)
        in_order = (lambda uid, cache: cache) if decoder is None else decoder.in_token_order
        return [
            (tokens[:], self.kept_cache(batch, uid, len(tokens), in_order(uid, cache)))
            for uid, (cache, tokens) in caches.items()
        ]

    def kv_bytes(self) -> int:
        return sum(b.kv_bytes() for b in self.by_key.values())

    def sequences(self) -> int:
        """Sequences decoding or prefilling in every batch."""
        return sum(b.running() for b in self.by_key.values())

    def reset(self) -> None:
        """Close every batch (a failed step lost them, or the engine went idle); the next requests
        start new ones."""
        self.by_key.clear()
        self._decoders.clear()
