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


@dataclass(eq=False)  # one per sequence: compared by identity
class ImagePrefill:
    sequence: Sequence
    cache: list
    done: int  # prompt positions the cache holds
    cached: int  # of those, how many came from the prefix cache
    positions: mx.array | None  # the prompt's rotary positions (VisionPrefill.positions)

    @property
    def end(self) -> int:
        """Positions the cache holds once prefilled: every prompt position but the last."""
        return len(self.sequence.request.prompt) - 1


class ImagePrefills:
    def __init__(self, vision: Callable[[], object]):
        """`vision()`: the model's VisionPrefill (vision/prefill.py)."""
        self._vision = vision
        self.pending: list[ImagePrefill] = []

    def add(self, prefill: ImagePrefill) -> None:
        self.pending.append(prefill)

    def task(self, budget: int) -> Callable[[], None] | None:
        """The forward advancing the oldest pending prompt by at most `budget` positions, or None."""
        if not self.pending:
            return None
        head = self.pending[0]
        stop = min(head.end, head.done + max(budget, 1))
        request = head.sequence.request

        def run() -> None:
            head.done = self._vision().prefill(
                head.cache, request.prompt, request.images, head.positions, head.done, stop
            )

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
