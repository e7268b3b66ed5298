"""The KV cache a new sequence starts from, and how many of its prompt positions it already holds.

A text prompt starts from the prefix cache's longest match (or an empty cache). A prompt with images
starts the same way under its image-keyed entry (vision/prefill.py `prefix_key`: an image's
positions are named by its pixels); the engine then prefills the rest of it, bar the last token,
through mlx-vlm's language model (image_prefills.py), and its batch sees it as a prefix-cache hit.

A finished sequence's cache goes to the prefix cache, and a later prompt reuses it trimmed to the
shared prefix. Recurrent layers (Gated DeltaNet) cannot be trimmed, so for such a model a prompt
with images also keeps copies of its prefilled cache (`keep_prefilled`), just past its last image
and at its end: a new question about the same images, the same turn again, or the conversation's
next turn starts from one.

With `--speculative mtp` an entry also carries the MTP layer's state over its positions
(speculative/mtp_prefix.py); a sequence that speculates resumes drafting from it, others drop it.
"""

from __future__ import annotations

import copy

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache

from services.core.kind_batches import KindBatches
from services.core.prefix_cache import PrefixCache
from services.core.sequence import Sequence
from services.core.speculative.mtp_prefix import split_prefix_state
from services.core.vision.prefill import VisionPrefill, prefix_key


class PromptStart:
    def __init__(self, prefix_cache: PrefixCache, batches: KindBatches):
        """`batches` make new caches and say whether sequences that speculate resume the MTP
        layer's state kept in the prefix cache (speculative/mtp_prefix.py)."""
        self.prefix_cache = prefix_cache
        self.batches = batches
        self.vision: VisionPrefill | None = None  # set once a model with a vision tower loads

    def cache_for(self, sequence: Sequence) -> tuple[list, int, mx.array | None]:
        """(the sequence's starting cache, the prompt positions it holds from the prefix cache, and
        for a prompt with images its rotary positions, `VisionPrefill.positions`). Runs on the
        engine thread."""
        request = sequence.request
        if request.prompt_logprobs:  # every prompt position is computed, so none comes from the cache
            return self.batches.new_cache(sequence.kind), 0, None
        images, positions = request.images, None
        if images is not None:
            if self.vision is None:
                raise ValueError("this model has no vision tower")
            positions, shift = self.vision.positions(request.prompt, images)
            sequence.prefix_keyer = lambda tokens: prefix_key(sequence.kind, tokens, images, shift)
        cache, cached = self.prefix_cache.lookup(*sequence.prefix_entry(request.prompt))
        resumes = images is None and request.speculative and self.batches.resumes_drafts()
        cache, cached, sequence.kept_draft_state = split_prefix_state(cache, cached, resumes)
        if cache is None:
            cache, cached = self.batches.new_cache(sequence.kind), 0
        return cache, cached, positions

    def keep_prefilled(self, sequence: Sequence, cache: list, done: int) -> None:
        """Keep a copy of `cache`, holding the prompt's first `done` positions, where the sequence's
        own cache will not serve later prompts (it cannot be trimmed back to them)."""
        if self.prefix_cache.enabled and not can_trim_prompt_cache(cache):
            tokens = sequence.request.prompt[:done]
            self.prefix_cache.store(*sequence.prefix_entry(tokens), copy.deepcopy(cache))
