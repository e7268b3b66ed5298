"""A layer call in flight: what ExpertDispatcher sent and how to collect its answer."""

from __future__ import annotations

import queue
import time

import mlx.core as mx
import numpy as np

from services.common import tensor_codec


class PendingCall:
    """One layer call between being sent and its answer being read: the dispatcher that made it,
    its plan, inputs, deadline and, when it was left in flight, the placeholder its answer goes
    into. `settle()` and `abandon()` are what the next layer (or a failed forward) calls."""

    def __init__(self, dispatcher, layer, plan, hidden, ids, started, deadline, dtype):
        self.dispatcher = dispatcher
        self.layer, self.plan, self.hidden, self.ids = layer, plan, hidden, ids
        self.dtype = dtype  # the states' own, both ways: the experts compute in what the model hands them
        self.started, self.deadline = started, deadline
        self.request_ids: tuple[str, ...] = ()
        self.frame_calls: list | None = None  # sent as frames: the calls whose answers are due
        self.replies: queue.SimpleQueue = queue.SimpleQueue()  # the gRPC path answers here
        self.slot: np.ndarray | None = None
        self.sent = 0.0  # perf_counter, and the monotonic clock in ns, when sending began
        self.sent_ns = 0

    def mark_sent(self) -> None:
        """Sending begins now: what came before is the call's encoding, what follows its send."""
        self.sent, self.sent_ns = time.perf_counter(), time.monotonic_ns()

    def seconds_left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def make_slot(self) -> mx.array:
        """The placeholder the answer will be written into: a [T, k, H] array in the call's dtype,
        NaN until then; self.slot is a writable numpy view of its bytes. Made from host memory,
        so it costs a copy and no evaluation."""
        tokens, k, dtype = *self.ids.shape, self.dtype
        nan = tensor_codec.nan_of(dtype)
        wire = mx.array(np.full((tokens, k, self.hidden.shape[-1]), nan, dtype=nan.dtype))
        self.slot = np.asarray(wire)
        return wire.view(dtype) if wire.dtype != dtype else wire

    def settle(self) -> None:
        """Write the answer into the placeholder (`make_slot`); raises the call's ExpertCallError."""
        self.dispatcher.finish(self, self.slot)

    def abandon(self) -> None:
        """Forget the call: nobody will read its answer (the forward that made it failed)."""
        self.dispatcher.abandon(self)
