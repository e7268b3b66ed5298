"""Prompts with images, prefilled a chunk per engine step before they join a batch.

The vision path (vision/prefill.py) runs a prompt with images through mlx-vlm's language model. Run
whole when the request arrives, it would hold every running sequence for as long as the prompt takes;
here it advances like any prefill, by the step's token budget, as one more forward of the step (its
expert calls join the step's others). A prompt whose cache holds every position but the last joins
its batch as a prefix-cache hit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from services.core.sequence import Sequence
from services.core.vision.prefill import image_spans


@dataclass(eq=False)  # one per sequence: compared by identity
class ImagePrefill:
    sequence: Sequence
    cache: list
    done: int  # prompt positions the cache holds
    cached: int  # of those, how many came from the prefix cache
    positions: mx.array | None  # the prompt's rotary positions (VisionPrefill.positions)
    keep_at: tuple[int, ...] = ()  # keep_points(), set when it is added

    @property
    def end(self) -> int:
        """Positions the cache holds once prefilled: every prompt position but the last."""
        return len(self.sequence.request.prompt) - 1

    def keep_points(self) -> tuple[int, ...]:
        """Where the prefilled cache is offered to the prefix cache (PromptStart.keep_prefilled):
        just past the last image, for a new question about the same images, and at the end."""
        request = self.sequence.request
        spans = image_spans(request.prompt, request.images)
        last = spans[-1][0] + spans[-1][1].span if spans else 0
        return tuple(sorted({p for p in (last, self.end) if self.done < p <= self.end}))


class ImagePrefills:
    def __init__(self, vision: Callable[[], object], keep: Callable[[Sequence, list, int], None]):
        """`vision()`: the model's VisionPrefill (vision/prefill.py); `keep(sequence, cache, done)`
        offers a cache holding the prompt's first `done` positions to the prefix cache."""
        self._vision = vision
        self._keep = keep
        self.pending: list[ImagePrefill] = []

    def add(self, prefill: ImagePrefill) -> None:
        prefill.keep_at = prefill.keep_points()
        self.pending.append(prefill)

    def task(self, budget: int) -> Callable[[], None] | None:
        """The forward advancing the oldest pending prompt by at most `budget` positions, not past
        its next keep point, and through at most one image the vision tower has yet to encode (an
        encode holds the whole step, so several are spread over steps), or None."""
        if not self.pending:
            return None
        head = self.pending[0]
        stop = min(head.end, head.done + max(budget, 1), *(p for p in head.keep_at if p > head.done))
        request = head.sequence.request
        vision = self._vision()
        features = vision.features
        to_encode = [
            first
            for first, image in image_spans(request.prompt, request.images)
            if first + image.span > head.done and first < stop and image.hash not in features
        ]
        if len(to_encode) > 1:
            stop = max(to_encode[1], head.done + 1)
        stop = vision.window_stop(request.prompt, request.images, stop)

        def run() -> None:
            head.done = vision.prefill(
                head.cache, request.prompt, request.images, head.positions, head.done, stop
            )
            if head.done in head.keep_at:
                self._keep(head.sequence, head.cache, head.done)

        return run

    def ready(self) -> list[ImagePrefill]:
        """Take out the prompts that are prefilled."""
        return self.take(lambda p: p.done >= p.end)

    def take(self, leaving: Callable[[ImagePrefill], bool]) -> list[ImagePrefill]:
        """Take out the pending prompts for which `leaving` holds (prefilled, cancelled, late)."""
        gone = [p for p in self.pending if leaving(p)]
        self.pending = [p for p in self.pending if all(p is not q for q in gone)]
        return gone

    def request_ids(self) -> tuple[str, ...]:
        return tuple(p.sequence.request.request_id for p in self.pending)
