"""What the engine keeps per request, and how its chunks reach the request's event loop.

Chunks made during an engine step are held in the step's `Outbox` and handed over at the end of
the step, one wake-up per event loop for all of them: each wake-up hands the interpreter to the
loop's thread, which then streams while the engine thread waits to build the next step.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from services.common.logging import get_logger
from services.core.expert_link.links import ExpertCallError
from services.core.request_prep import PreparedRequest
from services.core.text_output import TextEmitter

log = get_logger(__name__)


@dataclass(frozen=True)
class EngineError:
    """Sent on a request's queue instead of a chunk when the request fails."""

    code: grpc.StatusCode
    message: str


def step_failure(error: Exception) -> tuple[grpc.StatusCode, str]:
    """The status a failed engine step gives its requests: an expert call's own, else INTERNAL."""
    if isinstance(error, ExpertCallError):
        return error.code, str(error)
    log.error("engine_step_failed", exc_info=error)
    return grpc.StatusCode.INTERNAL, f"generation failed: {error}"


def _deliver(items: list[tuple[asyncio.Queue, object]]) -> None:
    for out, item in items:
        out.put_nowait(item)


class Outbox:
    """Items for requests' queues. Outside a step each goes at once; inside one (`holding`) they
    wait for `flush()`, which sends each event loop its items in order, in one callback."""

    def __init__(self):
        self.holding = False
        self._held: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)

    def put(self, loop: asyncio.AbstractEventLoop, out: asyncio.Queue, item) -> None:
        if self.holding:
            self._held[loop].append((out, item))
        else:
            loop.call_soon_threadsafe(out.put_nowait, item)

    def flush(self) -> None:
        self.holding = False
        held, self._held = self._held, defaultdict(list)
        for loop, items in held.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that loop has closed: its requests are gone with it
                pass


@dataclass
class Sequence:
    request: PreparedRequest
    out: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    emitter: TextEmitter
    outbox: Outbox
    kind: str = ""  # KV cache kind
    batch: tuple[str, int] = ("", 0)  # the batch it runs in: (kind, micro-batch lane)
    uid: int | None = None  # the uid its batch gave it
    generated: int = 0
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    # with request.prompt_logprobs: one entry per prompt token scored so far, sent on the first chunk
    prompt_logprobs: list = field(default_factory=list)
    done: bool = False
    submitted_at: float = field(default_factory=time.monotonic)
    prefill_started_at: float | None = None
    first_token_at: float | None = None
    # (tokens) -> (kind, tokens) the prefix cache keys this sequence's KV by; None: (kind, tokens)
    prefix_keyer: Callable[[list[int]], tuple[str, list[int]]] | None = None
    # the MTP layer's state kept with the prefix-cache entry it starts from (speculative/mtp_prefix.py)
    kept_draft_state: object = None

    @property
    def key(self) -> tuple[tuple[str, int], int | None]:
        return (self.batch, self.uid)

    def prefix_entry(self, tokens: list[int]) -> tuple[str, list[int]]:
        """(kind, tokens) under which the prefix cache keeps this sequence's KV of `tokens`."""
        return (self.kind, list(tokens)) if self.prefix_keyer is None else self.prefix_keyer(list(tokens))

    def send(self, item) -> None:
        self.outbox.put(self.loop, self.out, item)
