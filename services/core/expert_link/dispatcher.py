"""Core's side of the expert links: placement, one bidi stream per worker, the layer call.

`ExpertDispatcher.call(layer, hidden, expert_ids)` is what every remote expert
module calls, synchronously, from inside the model's forward pass on the engine
thread. The gRPC streams live on an I/O thread that runs a uvloop event loop
forever; a call is handed over with one `call_soon_threadsafe` and the reply comes
back through a SimpleQueue (cheaper per round trip than driving a private loop with
`run_until_complete` from the engine thread: bench/dispatcher_ab.py).

Hidden states travel in the model's own dtype as raw bytes; grouping and reassembly
are numpy index operations on host memory, so the layer costs exactly one MLX
synchronisation (`mx.eval` of hidden states and expert ids together) and one array
construction on the way back.

Replicas and failover: an expert may be held by several workers. Each call spreads
the experts over their live replicas (rotating, so load balances across calls); a
part that fails on a link (reset, closed stream, no answer in time) marks that link
down and is re-sent to another replica within the same call deadline, so the engine
never sees the failure. Only when some (layer, expert) has no live replica left does
the call fail, with UNAVAILABLE naming the missing ranges. A down link is re-described
in the background with exponential backoff and used again as soon as it answers with
the right model: no core restart. A layer call is a pure function of its inputs, so a
retry gives the same numbers.

The data paths are mixed in from their own modules: routing (routes.py), the same-host frame
sockets (frames_path.py) and the gRPC streams with failover (grpc_path.py); the call in flight
is a PendingCall (pending.py) that the next layer settles.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time

import grpc
import mlx.core as mx
import numpy as np

from services.common import tensor_codec
from services.common.logging import get_logger
from services.common.manifest import Manifest
from services.common.tls import TlsFiles
from services.core.expert_link import metrics as expert_metrics
from services.core.expert_link.deadlines import AttemptDeadlines
from services.core.expert_link.frames_path import FramePathMixin
from services.core.expert_link.grpc_path import GrpcPathMixin
from services.core.expert_link.in_flight import IN_FLIGHT, settle_pending
from services.core.expert_link.links import (
    BATCH_REQUEST_IDS,
    ExpertCallError,
    LayerCallTimings,
    WorkerLink,
)
from services.core.expert_link.pending import PendingCall
from services.core.expert_link.routes import CallPart, RoutingMixin, plan_parts
from services.proto.moemesh.v1 import expert_pb2

log = get_logger(__name__)

RECONNECT_BACKOFF_S = (0.1, 5.0)  # first retry, cap; doubles in between
# How long past a call's deadline the engine waits for the I/O loop's answer. The loop answers
# every call by its deadline; one that has not answered by then is lost (a bug, or a loop that
# is stuck), and the engine fails that layer call instead of waiting forever.
REPLY_GRACE_S = 5.0


def overlap_by_default() -> bool:
    """Overlap writes each answer into an evaluated MLX array's memory from the host. That is
    plain memory on the CPU, where the test suite runs with it on every architecture; on GPUs
    it has only been spot-checked (MLX CUDA) or not at all (Metal), so they wait for each
    layer unless `--expert-overlap on` says otherwise."""
    return mx.default_device() == mx.cpu


class ExpertDispatcher(RoutingMixin, FramePathMixin, GrpcPathMixin):
    """Routes every (token, expert) pair of a layer call to a live worker that holds the expert.

    Contract: `call()` returns [T, k, H] or raises ExpertCallError — UNAVAILABLE only when some
    routed expert has no live replica (the message names the (layer, expert) ranges) or the call
    deadline passed; INVALID_ARGUMENT/INTERNAL answered in-band by a worker are not retried on the
    same worker but are on a replica (a bad disk on one host must not fail the request).
    """

    def __init__(
        self,
        manifest: Manifest,
        worker_addresses: list[str],
        call_timeout_s: float = 60.0,
        max_message_bytes: int = 512 * 1024 * 1024,
        tls: TlsFiles | None = None,
        frames: bool = True,
        frame_spin_s: float = 0.0,
        overlap: bool | None = None,
        layers: set[int] | None = None,
    ):
        """`layers`: the MoE layers it routes (default: all; the others compute in core's process,
        expert_link/local.py); `frames`: send calls to workers on this host through their frame sockets
        (services/core/expert_link/frame_link.py) rather than their gRPC streams, where they offer one;
        `frame_spin_s`: how long a read of their answers polls before it sleeps; `overlap`:
        let core build the next layer while the experts compute (see `call_overlapped`; None:
        on the CPU only, see `overlap_by_default`)."""
        if not worker_addresses:
            raise ValueError("at least one expert worker address is needed")
        self.manifest = manifest
        self.call_timeout_s = call_timeout_s
        self.tls = tls
        self.use_frames = frames
        self.frame_spin_s = frame_spin_s
        self.overlap = overlap_by_default() if overlap is None else overlap
        # The I/O loop and its thread. Channels are created inside the loop (see _discover)
        # so they bind to it and to no other loop.
        self.loop = _new_event_loop()
        self._deadlines = AttemptDeadlines(self.loop)
        self._abandoned: set[asyncio.Task] = set()  # replicated-layer attempts left behind (_attempt_apart)
        self._io_thread = threading.Thread(target=self.loop.run_forever, name="expert-io", daemon=True)
        self._io_thread.start()
        self._addresses = list(dict.fromkeys(worker_addresses))
        self._max_message_bytes = max_message_bytes
        self.links: list[WorkerLink] = []
        self._num_experts = {
            layer.layer: layer.num_experts
            for layer in manifest.layers
            if layers is None or layer.layer in layers
        }
        # Its answer is needed before the model's output exists: never left in flight.
        self._last_layer = max(self._num_experts)
        # routes[layer] = (replicas [E, R] link indices padded with -1, live replica count [E]);
        # swapped whole (never mutated) so the engine thread always reads a consistent table.
        self.routes: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._sole_owner: dict[int, int] = {}  # layer -> the one link holding all of it
        self._rebuild_routes()
        self.timings = LayerCallTimings()
        self._rotation = itertools.count()
        self._layer_seconds = {
            layer: expert_metrics.LAYER_CALL_SECONDS.labels(str(layer)) for layer in self._num_experts
        }
        self._closing = False
        self._last_down: list[str] = []
        # what Describe asks: join_data_plane when core carries calls in-graph (distributed.py)
        self.describe_request = expert_pb2.DescribeRequest()

    # ---- placement -------------------------------------------------------------------------

    def discover(self, timeout_s: float = 5.0) -> list[str]:
        """Describe every worker, rebuild the routes; return problems (empty = every expert of
        every layer has a live worker). A down worker whose experts all have live replicas is
        not a problem (core serves on; the worker_up metric and the log show it)."""
        answers = asyncio.run_coroutine_threadsafe(self._discover(timeout_s), self.loop)
        try:  # Describe has its deadline; this bounds a stuck I/O loop too
            return answers.result(timeout_s + 5.0)
        except TimeoutError:
            answers.cancel()
            raise

    async def _discover(self, timeout_s: float) -> list[str]:
        if not self.links:
            self.links = [WorkerLink(a, self._max_message_bytes, self.tls) for a in self._addresses]
        replies = await asyncio.gather(
            *(self._describe(link, timeout_s) for link in self.links), return_exceptions=True
        )
        down = [str(reply) for reply in replies if isinstance(reply, BaseException)]
        self._rebuild_routes()
        gaps = self.coverage_gaps()
        if down and down != self._last_down and not gaps:  # degraded but covered: once per change
            log.warning("expert_workers_down_replicas_cover", workers=down)
        self._last_down = down
        return [*down, *gaps] if gaps else []

    # ---- the layer call ----------------------------------------------------------------------

    def call(self, layer: int, hidden: mx.array, expert_ids: mx.array) -> mx.array:
        """hidden [T, H] in the model dtype or its wire form, expert_ids [T, k] int32, both
        evaluated -> [T, k, H] in the model dtype."""
        settle_pending()  # at most one call in flight per engine thread
        return self.finish(self._start(layer, hidden, expert_ids))

    def call_overlapped(self, layer: int, hidden: mx.array, expert_ids: mx.array) -> mx.array:
        """`call` for the model's forward pass. With `overlap`, every layer but the last answers
        at once with a placeholder that the call's result fills in later (`settle_pending()`,
        which `RemoteExperts` runs before it evaluates anything): core builds the next layer's
        graph in Python while the worker computes, as monolithic mlx-lm overlaps its Python with
        its own compute. The placeholder holds NaN until then, so a read before that could not
        pass for numbers."""
        if not self.overlap or layer == self._last_layer:
            return self.call(layer, hidden, expert_ids)
        settle_pending()
        pending = self._start(layer, hidden, expert_ids)
        slot = pending.make_slot()
        IN_FLIGHT.call = pending
        return slot

    def start_call(self, layer: int, hidden: mx.array, expert_ids: mx.array) -> PendingCall:
        """Send a layer call (inputs as for `call`) and return at once; `finish(pending)` reads
        its answer. Calls started one after another are answered in the order they were sent."""
        settle_pending()
        return self._start(layer, hidden, expert_ids)

    def queues_behind(self, earlier: PendingCall, nbytes: int) -> bool:
        """Whether a call of about `nbytes` may be sent while `earlier` is still unanswered. Only
        over frame sockets whose send buffers take it whole: a worker reads its next call only
        after writing the last answer, which nobody reads while core is still sending. A gRPC
        call is waited for first (one call at a time per stream)."""
        if earlier.frame_calls is None:
            return False
        return all(self.links[part.link].frames.room() >= 2 * nbytes for part in earlier.plan)

    def _start(self, layer: int, hidden: mx.array, expert_ids: mx.array) -> PendingCall:
        started = time.perf_counter()
        ids = tensor_codec.numpy_view(expert_ids)  # evaluated int32 (RemoteExperts made it so)
        host_hidden = tensor_codec.numpy_view(hidden)
        dtype = tensor_codec.hidden_dtype_of(host_hidden)
        if self.overlap and tensor_codec.has_nan(host_hidden, dtype):
            self._overlap_failed(layer)
        sole = self._sole_owner.get(layer)
        if sole is not None:
            plan = [CallPart(sole, None, host_hidden, ids)]
        else:
            try:
                owners = self._choose(layer, ids, next(self._rotation))
            except ExpertCallError as error:
                expert_metrics.LAYER_CALL_FAILURES.labels(error.code.name).inc()
                raise
            plan = plan_parts(owners, host_hidden, ids)
        # One deadline, whichever path serves.
        pending = PendingCall(
            self, layer, plan, host_hidden, ids, started, time.monotonic() + self.call_timeout_s, dtype
        )
        pending.request_ids = BATCH_REQUEST_IDS.get()
        pending.frame_calls = self._frames_send(pending)
        if pending.frame_calls is None:
            pending.mark_sent()  # the I/O loop encodes and writes: all of that is the send's
            self._grpc_start(pending)
        return pending

    def _overlap_failed(self, layer: int) -> None:
        """NaN reached a layer's input while calls overlap: most likely the model evaluated
        something between two MoE layers, which read a placeholder before its answer was in
        (an architecture that evaluates inside its forward pass). Overlap is turned off for
        good and this step fails; the next ones compute as without overlap."""
        self.overlap = False
        log.warning("expert_overlap_disabled", layer=layer, reason="NaN in the hidden states")
        expert_metrics.LAYER_CALL_FAILURES.labels("INTERNAL").inc()
        raise ExpertCallError(
            grpc.StatusCode.INTERNAL,
            f"layer {layer}: the hidden states hold NaN; overlapped expert calls are now off "
            "(this model or device reads arrays before their answer is in: run core with --expert-overlap off)",
        )

    def finish(self, pending: PendingCall, slot: np.ndarray | None = None) -> mx.array | None:
        """Wait for the call's answers; return them as one MLX array, or write them into `slot`."""
        results = None
        if pending.frame_calls is not None:
            results = self._frames_receive(pending)
            if results is None:  # a connection broke, or an answer the gRPC path must handle
                self._grpc_start(pending)
        one_clock = results is not None  # frame links are same-host: the worker's clock is ours
        if results is None:
            try:
                ok, results = pending.replies.get(timeout=pending.seconds_left() + REPLY_GRACE_S)
            except queue.Empty:
                ok, results = False, self._lost(pending)
            if not ok:
                expert_metrics.LAYER_CALL_FAILURES.labels(results.code.name).inc()
                raise results
        arrived, arrived_ns = time.perf_counter(), time.monotonic_ns()

        tokens, k = pending.ids.shape
        hidden_size = pending.hidden.shape[-1]
        if slot is not None:
            out = slot.reshape(tokens * k, hidden_size)
        elif len(results) == 1 and results[0][0] is None:
            out = None
        else:
            out = np.empty((tokens * k, hidden_size), dtype=pending.hidden.dtype)
        if out is not None:
            for mask, rows, _ in results:
                if mask is None:
                    out[:] = rows
                else:
                    out[np.flatnonzero(mask)] = rows
        array = None
        if slot is None:
            array = tensor_codec.to_mlx(
                (results[0][1] if out is None else out).reshape(tokens, k, hidden_size)
            )
        stats = [r[2] for r in results]
        worker_us = max(s.decode_us + s.compute_us + s.encode_us for s in stats)
        compute_us = max(s.compute_us for s in stats)
        finished = time.perf_counter()
        elapsed = finished - pending.started
        self.timings.record(elapsed * 1e6, worker_us, compute_us, pending.layer)
        self.timings.record_call_parts(pending, stats, one_clock, arrived, arrived_ns, finished)
        self._layer_seconds[pending.layer].observe(elapsed)
        return array

    def abandon(self, pending: PendingCall) -> None:
        """Forget a call nobody will read (its forward failed). A frame answer still on its way
        would be taken for the next call's, so those connections are closed; a gRPC call is
        waited for (within its deadline), since a second call on the same stream must not
        overlap it."""
        if pending.frame_calls is not None:
            self._close_frames(pending)
            return
        try:
            pending.replies.get(timeout=pending.seconds_left())
        except queue.Empty:
            pass

    # ---- reconnect ---------------------------------------------------------------------------

    def _link_failed(self, link: WorkerLink) -> None:
        """Stop routing to the link; _set_link describes it again in the background until it is back."""
        if link.up:
            self._set_link(link, None)

    async def _reconnect(self, link: WorkerLink) -> None:
        delay, cap = RECONNECT_BACKOFF_S
        while not self._closing and not link.up:
            await asyncio.sleep(delay)
            try:
                await self._describe(link, timeout_s=2.0)
            except RuntimeError:
                delay = min(delay * 2, cap)

    def close(self) -> None:
        async def _close():
            self._closing = True
            for link in self.links:
                if link.reconnecting is not None:
                    link.reconnecting.cancel()
                link.reset()
                await link.channel.close()
                if link.frames is not None:
                    link.frames.close()

        asyncio.run_coroutine_threadsafe(_close(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._io_thread.join(timeout=10)


def _new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:  # pragma: no cover
        return asyncio.new_event_loop()
