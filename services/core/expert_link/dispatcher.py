"""Core's side of the expert links: placement, one bidi stream per worker, the layer call.

`ExpertDispatcher.call(layer, hidden, expert_ids)` is what every remote expert
module calls, synchronously, from inside the model's forward pass on the engine
thread. The gRPC streams live on an I/O thread that runs a uvloop event loop
forever; a call is handed over with one `call_soon_threadsafe` and the reply comes
back through a SimpleQueue. Measured on the 2-core CI box with an echo worker, that
costs ~200 us per round trip against ~280 us for driving a private loop with
`run_until_complete` from the engine thread (in-loop floor: ~160 us).

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
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import os
import queue
import socket
import threading
import time
from collections import deque

import grpc
import mlx.core as mx
import numpy as np

from services.common import tensor_codec
from services.common.frames import FrameError
from services.common.grpc_util import aio_channel, normalize_address
from services.common.logging import REQUEST_ID_METADATA_KEY, get_logger
from services.common.manifest import Manifest
from services.common.ranges import format_ranges
from services.common.tls import TlsFiles
from services.core.expert_link import metrics as expert_metrics
from services.core.expert_link.deadlines import AttemptDeadlines
from services.core.expert_link.frame_link import FrameLink
from services.core.expert_link.in_flight import IN_FLIGHT, settle_pending
from services.proto.moemesh.v1 import expert_pb2, expert_pb2_grpc, tensor_pb2

log = get_logger(__name__)

# The request ids of the batch being stepped, set by the engine thread before each step
# (the layer calls run on that same thread); they ride in every ExpertCall for worker logs.
BATCH_REQUEST_IDS: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar(
    "batch_request_ids", default=()
)
RECONNECT_BACKOFF_S = (0.1, 5.0)  # first retry, cap; doubles in between
# How long past a call's deadline the engine waits for the I/O loop's answer. The loop answers
# every call by its deadline; one that has not answered by then is lost (a bug, or a loop that
# is stuck), and the engine fails that layer call instead of waiting forever.
REPLY_GRACE_S = 5.0
CORE_LINK_ID = f"core-{socket.gethostname()}-{os.getpid()}"


class ExpertCallError(RuntimeError):
    """A layer call failed. `code` is the grpc.StatusCode the request should fail with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class LayerCallTimings:
    """Per layer call, in microseconds, over a sliding window: where the time goes.

    `record` keeps each call's (total, worker, compute); `record_part` the parts of a call and
    of the engine step around it, by name (core_sync, encode_send, send, worker_decode,
    worker_compute, worker_encode, reply, core_decode, engine_step). Written by the engine
    thread, read by the servicer thread, hence the lock.
    """

    def __init__(self, window: int = 8192):
        self._lock = threading.Lock()
        self._window = window
        self._calls: deque[tuple[float, float, float]] = deque(maxlen=window)  # (total, worker, compute)
        self._parts: dict[str, deque[float]] = {}

    def record(self, total: float, worker: float, compute: float) -> None:
        with self._lock:
            self._calls.append((total, worker, compute))

    def record_part(self, name: str, microseconds: float) -> None:
        with self._lock:
            values = self._parts.get(name)
            if values is None:
                values = self._parts[name] = deque(maxlen=self._window)
            values.append(microseconds)

    def snapshot(self, reset: bool = False) -> np.ndarray:
        """[n, 3] array of (total, worker, compute) microseconds."""
        return self.snapshot_all(reset)[0]

    def snapshot_all(self, reset: bool = False) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """(`snapshot()`, {part: its microseconds}); `reset` clears both."""
        with self._lock:
            rows = np.array(self._calls, dtype=np.float64).reshape(-1, 3)
            parts = {name: np.array(values, dtype=np.float64) for name, values in self._parts.items()}
            if reset:
                self._calls.clear()
                self._parts.clear()
        return rows, parts

    def __len__(self) -> int:
        return len(self._calls)


class WorkerLink:
    """One worker: its channel, its long-lived Forward stream (recreated after a failure),
    what it holds (from Describe) and whether core currently routes to it."""

    def __init__(self, address: str, max_message_bytes: int, tls: TlsFiles | None):
        self.address = normalize_address(address)
        self.channel = aio_channel(self.address, tls, max_message_bytes)
        self.stub = expert_pb2_grpc.ExpertWorkerStub(self.channel)
        self.stream: grpc.aio.StreamStreamCall | None = None
        self.describe: expert_pb2.DescribeResponse | None = None
        self.frames: FrameLink | None = None  # the same-host data path, when the worker offers one
        self.up = False
        self.reconnecting: asyncio.Task | None = None
        self.calls_metric = expert_metrics.WORKER_CALLS.labels(self.address)
        self.retries_metric = expert_metrics.WORKER_RETRIES.labels(self.address)
        self.up_metric = expert_metrics.WORKER_UP.labels(self.address)
        self.up_metric.set(0)

    def open_stream(self) -> grpc.aio.StreamStreamCall:
        if self.stream is None or self.stream.done():
            # The worker logs this link's lines under the core's identity; per-request ids ride
            # in each ExpertCall, since one stream carries every request of every step.
            self.stream = self.stub.Forward(metadata=((REQUEST_ID_METADATA_KEY, CORE_LINK_ID),))
        return self.stream

    def reset(self) -> None:
        if self.stream is not None:
            self.stream.cancel()
        self.stream = None

    def set_up(self, up: bool) -> None:
        self.up = up
        self.up_metric.set(1 if up else 0)


# What a replicated layer's attempt gets past its own deadline (which normally ends it first)
# before it is abandoned: enough for the deadline's cancellation to land, short against the budget.
ABANDON_AFTER_S = 0.25


class _Part:
    """The pairs of one layer call sent to one worker. `mask` [T, k] marks them (None = all)."""

    __slots__ = ("hidden", "ids", "link", "mask")

    def __init__(self, link: int, mask: np.ndarray | None, hidden: np.ndarray, ids: np.ndarray):
        self.link, self.mask, self.hidden, self.ids = link, mask, hidden, ids


class _Pending:
    """One layer call between `_start` and `_finish`."""

    def __init__(self, layer, plan, hidden, ids, started, deadline, dtype):
        self.layer, self.plan, self.hidden, self.ids = layer, plan, hidden, ids
        self.dtype = dtype  # the states' own, both ways: the experts compute in what the model hands them
        self.started, self.deadline = started, deadline
        self.request_ids: tuple[str, ...] = ()
        self.frame_calls: list | None = None  # sent as frames: the calls whose answers are due
        self.replies: queue.SimpleQueue = queue.SimpleQueue()  # the gRPC path answers here
        self.slot: np.ndarray | None = None
        self.sent = 0.0  # perf_counter, and the monotonic clock in ns, once every part was sent
        self.sent_ns = 0

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


def overlap_by_default() -> bool:
    """Overlap writes each answer into an evaluated MLX array's memory from the host. That is
    plain memory on the CPU, where the test suite runs with it on every architecture; on GPUs
    it has only been spot-checked (MLX CUDA) or not at all (Metal), so they wait for each
    layer unless `--expert-overlap on` says otherwise."""
    return mx.default_device() == mx.cpu


class ExpertDispatcher:
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
        self._call_ids = itertools.count(1)
        self._rotation = itertools.count()
        self._layer_seconds = {
            layer: expert_metrics.LAYER_CALL_SECONDS.labels(str(layer)) for layer in self._num_experts
        }
        self._closing = False
        self._last_down: list[str] = []

    # ---- placement -------------------------------------------------------------------------

    def discover(self, timeout_s: float = 5.0) -> list[str]:
        """Describe every worker, rebuild the routes; return problems (empty = every expert of
        every layer has a live worker). A down worker whose experts all have live replicas is
        not a problem (core serves on; the worker_up metric and the log show it)."""
        return asyncio.run_coroutine_threadsafe(self._discover(timeout_s), self.loop).result()

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

    async def _describe(self, link: WorkerLink, timeout_s: float) -> None:
        """Describe one link and mark it up or down; raises a readable error when down."""
        try:
            reply = await link.stub.Describe(expert_pb2.DescribeRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as error:
            self._set_link(link, None)
            raise RuntimeError(f"expert worker {link.address} is unreachable: {error.details()}") from None
        if reply.model_fingerprint != self.manifest.fingerprint:
            self._set_link(link, None)
            raise RuntimeError(
                f"expert worker {link.address} serves model {reply.model_fingerprint}, core has {self.manifest.fingerprint}"
            )
        self._set_link(link, reply)

    def _set_link(self, link: WorkerLink, describe: expert_pb2.DescribeResponse | None) -> None:
        """Runs on the I/O loop. A link going down gets a background reconnect with backoff, and
        the routes follow every change of a link's state here, whoever noticed it: a Describe
        that timed out once marked a SIGSTOPped replica down without rebuilding them, and every
        later layer call kept waiting half its deadline on it."""
        was_up = link.up
        link.describe = describe
        if describe is not None and describe.frames_path and self.use_frames:
            if link.frames is None or link.frames.path != describe.frames_path:
                link.frames = FrameLink(describe.frames_path, self._max_message_bytes, self.frame_spin_s)
        link.set_up(describe is not None)
        if was_up and not link.up:
            link.reset()
            log.warning("expert_worker_down", worker=link.address)
        elif link.up and not was_up and describe is not None:
            log.info("expert_worker_up", worker=link.address, worker_id=describe.worker_id)
        if not link.up and not self._closing and (link.reconnecting is None or link.reconnecting.done()):
            link.reconnecting = self.loop.create_task(self._reconnect(link))
        if link.up != was_up:
            self._rebuild_routes()

    def _rebuild_routes(self) -> None:
        held: dict[int, list[list[int]]] = {
            layer: [[] for _ in range(n)] for layer, n in self._num_experts.items()
        }
        for index, link in enumerate(self.links):
            if not link.up or link.describe is None:
                continue
            for layer_experts in link.describe.layers:
                owners = held.get(layer_experts.layer)
                if owners is None:
                    continue
                for expert in layer_experts.experts:
                    if expert < len(owners):
                        owners[expert].append(index)
        routes = {}
        for layer, owners in held.items():
            width = max(1, *(len(o) for o in owners))
            replicas = np.full((len(owners), width), -1, dtype=np.int32)
            for expert, o in enumerate(owners):
                replicas[expert, : len(o)] = o
            routes[layer] = (replicas, np.array([len(o) for o in owners], dtype=np.int32))
        # The usual placement (one live worker holds the whole layer, no replica): the layer call
        # skips per-pair routing. Read without a lock: a stale entry names a link that still
        # held the layer a moment ago, and a call that finds it down fails over like any other.
        self._sole_owner = {
            layer: owners[0][0]
            for layer, owners in held.items()
            if owners and all(len(o) == 1 and o[0] == owners[0][0] for o in owners)
        }
        self.routes = routes

    def coverage_gaps(self) -> list[str]:
        gaps = []
        for layer, (_, count) in sorted(self.routes.items()):
            missing = np.flatnonzero(count == 0).tolist()
            if missing:
                gaps.append(f"layer {layer} experts {format_ranges(missing)} have no reachable worker")
        return gaps

    def replica_counts(self) -> dict[int, np.ndarray]:
        """Live replicas per expert, per layer (for health and stats)."""
        return {layer: count.copy() for layer, (_, count) in self.routes.items()}

    def _choose(
        self, layer: int, ids: np.ndarray, rotation: int, exclude: tuple[int, ...] = ()
    ) -> np.ndarray:
        """Link index per pair (same shape as `ids`), spreading each expert over its live
        replicas other than `exclude`; raises UNAVAILABLE naming the experts that have none."""
        replicas, count = self.routes[layer]
        if exclude:
            usable = (replicas >= 0) & ~np.isin(replicas, exclude)
            replicas = np.take_along_axis(replicas, np.argsort(~usable, axis=1, kind="stable"), axis=1)
            count = usable.sum(axis=1).astype(np.int32)
        counts = count[ids]
        if counts.min() <= 0:
            missing = sorted(set(ids[counts <= 0].tolist()))
            raise ExpertCallError(
                grpc.StatusCode.UNAVAILABLE,
                f"layer {layer} experts {format_ranges(missing)} have no reachable worker",
            )
        if replicas.shape[1] == 1:
            return replicas[ids, 0]
        return replicas[ids, (ids + rotation) % counts]

    # ---- the layer call ----------------------------------------------------------------------

    def call(self, layer: int, hidden: mx.array, expert_ids: mx.array) -> mx.array:
        """hidden [T, H] in the model dtype or its wire form, expert_ids [T, k] int32, both
        evaluated -> [T, k, H] in the model dtype."""
        settle_pending()  # at most one call in flight per engine thread
        return self._finish(self._start(layer, hidden, expert_ids))

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
        IN_FLIGHT.call = (self, pending)
        return slot

    def _start(self, layer: int, hidden: mx.array, expert_ids: mx.array) -> _Pending:
        started = time.perf_counter()
        ids = np.asarray(expert_ids)  # evaluated int32 (RemoteExperts made it so): a view, no sync
        host_hidden = tensor_codec.numpy_view(hidden)
        dtype = tensor_codec.hidden_dtype_of(host_hidden)
        if self.overlap and tensor_codec.has_nan(host_hidden, dtype):
            self._overlap_failed(layer)
        sole = self._sole_owner.get(layer)
        if sole is not None:
            plan = [_Part(sole, None, host_hidden, ids)]
        else:
            try:
                owners = self._choose(layer, ids, next(self._rotation))
            except ExpertCallError as error:
                expert_metrics.LAYER_CALL_FAILURES.labels(error.code.name).inc()
                raise
            plan = _plan(owners, host_hidden, ids)
        # One deadline, whichever path serves.
        pending = _Pending(
            layer, plan, host_hidden, ids, started, time.monotonic() + self.call_timeout_s, dtype
        )
        pending.request_ids = BATCH_REQUEST_IDS.get()
        pending.frame_calls = self._frames_send(pending)
        if pending.frame_calls is None:
            self._grpc_start(pending)
        pending.sent, pending.sent_ns = time.perf_counter(), time.monotonic_ns()
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

    def _grpc_start(self, pending: _Pending) -> None:
        """Hand the call to the gRPC streams (the I/O loop); its answer arrives in pending.replies."""
        budget = pending.seconds_left()
        # The coroutine object is made here; the loop only has to start it.
        roundtrip = self._roundtrip(
            pending.layer,
            pending.plan,
            pending.hidden,
            pending.ids,
            pending.request_ids,
            budget,
            pending.replies,
        )
        try:
            self.loop.call_soon_threadsafe(self.loop.create_task, roundtrip)
        except RuntimeError:  # the loop is closed: the dispatcher was closed
            roundtrip.close()
            raise

    def _finish(self, pending: _Pending, slot: np.ndarray | None = None) -> mx.array | None:
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
            array = mx.array((results[0][1] if out is None else out).reshape(tokens, k, hidden_size))
            if pending.dtype == mx.bfloat16:
                array = array.view(mx.bfloat16)
        stats = [r[2] for r in results]
        worker_us = max(s.decode_us + s.compute_us + s.encode_us for s in stats)
        compute_us = max(s.compute_us for s in stats)
        finished = time.perf_counter()
        elapsed = finished - pending.started
        self.timings.record(elapsed * 1e6, worker_us, compute_us)
        self._record_parts(pending, stats, one_clock, arrived, arrived_ns, finished)
        self._layer_seconds[pending.layer].observe(elapsed)
        return array

    def _record_parts(self, pending: _Pending, stats, one_clock: bool, arrived, arrived_ns, finished) -> None:
        """The call's parts (LayerCallTimings): the slowest worker's where several answered."""
        record = self.timings.record_part
        record("encode_send", (pending.sent - pending.started) * 1e6)
        record("core_decode", (finished - arrived) * 1e6)
        for name in ("decode", "compute", "encode"):
            record(f"worker_{name}", max(getattr(s, f"{name}_us") for s in stats))
        if one_clock and all(s.started_ns for s in stats):
            record("send", (max(s.started_ns for s in stats) - pending.sent_ns) / 1e3)
            record("reply", (arrived_ns - max(s.finished_ns for s in stats)) / 1e3)

    def _frames_send(self, pending: _Pending) -> list | None:
        """Send the call's parts over the workers' frame sockets, on this (the engine) thread.
        None when the plan cannot go that way (a replicated layer, whose failover lives in the
        gRPC path; a worker without a frame socket) or a connection broke on the way: the call
        then goes through the gRPC streams, which retry, fail over or name what is missing."""
        layer, plan = pending.layer, pending.plan
        if not self.use_frames or self.routes[layer][0].shape[1] > 1:
            return None
        links = [self.links[part.link] for part in plan]
        frames = [link.frames for link in links]
        if not all(link.up for link in links) or any(f is None or not f.usable for f in frames):
            return None
        calls = []
        try:
            for part, link, frame_link in zip(plan, links, frames, strict=True):
                link.calls_metric.inc()
                calls.append(self._expert_call(layer, part.hidden, part.ids, pending.request_ids))
                frame_link.send(calls[-1], pending.deadline)
        except FrameError as error:
            return self._frames_failed(pending, links[len(calls) - 1], error)
        return calls

    def _frames_receive(self, pending: _Pending) -> list[tuple] | None:
        """Every part's answer from its frame socket. None when a connection broke or a worker
        answered with an error other than INVALID_ARGUMENT (the caller then makes the same
        call through gRPC). A worker that does not answer in time fails the call here
        (UNAVAILABLE), within the call's deadline."""
        plan = pending.plan
        links = [self.links[part.link] for part in plan]
        replies = []
        try:
            for link in links:
                replies.append(link.frames.receive(pending.deadline))
        except FrameError as error:
            return self._frames_failed(pending, links[len(replies)], error)
        results = []
        for part, link, call, result in zip(plan, links, pending.frame_calls, replies, strict=True):
            if result.call_id != call.call_id:
                self._close_frames(pending)
                return None
            if result.HasField("error"):
                code = _status_code(result.error.code)
                if code != grpc.StatusCode.INVALID_ARGUMENT:
                    return None  # the gRPC path retries it on a replica or names the failure
                expert_metrics.WORKER_ERRORS.labels(link.address, code.name).inc()
                expert_metrics.LAYER_CALL_FAILURES.labels(code.name).inc()
                raise ExpertCallError(code, f"expert worker {link.address}: {result.error.message}")
            rows = tensor_codec.decode_numpy(result.output, "output", 1 << 40, ndim=2)
            results.append((part.mask, rows, result.stats))
        return results

    def _frames_failed(self, pending: _Pending, link: WorkerLink, error: FrameError) -> None:
        """A frame connection broke (None: use gRPC) or timed out (raises UNAVAILABLE)."""
        self._close_frames(pending)  # answers still in flight would be read as the next call's
        if not error.timed_out:
            log.info("frames_fallback", worker=link.address, layer=pending.layer, error=str(error))
            return None
        expert_metrics.WORKER_ERRORS.labels(link.address, "UNAVAILABLE").inc()
        self.loop.call_soon_threadsafe(self._link_failed, link)
        expert_metrics.LAYER_CALL_FAILURES.labels("UNAVAILABLE").inc()
        raise ExpertCallError(
            grpc.StatusCode.UNAVAILABLE,
            f"expert worker {link.address} did not answer layer {pending.layer} within {self.call_timeout_s:g} s",
        ) from None

    def _close_frames(self, pending: _Pending) -> None:
        for part in pending.plan:
            frames = self.links[part.link].frames
            if frames is not None:
                frames.close()

    def _lost(self, pending: _Pending) -> ExpertCallError:
        """The error for a gRPC call that never answered; its links' streams are reset, so that
        a late answer cannot be read as the next call's and the next call opens a fresh stream."""
        links = [self.links[part.link] for part in pending.plan]
        for link in links:
            self.loop.call_soon_threadsafe(link.reset)
        addresses = ", ".join(dict.fromkeys(link.address for link in links))
        log.error("expert_call_lost", layer=pending.layer, workers=addresses)
        return ExpertCallError(
            grpc.StatusCode.UNAVAILABLE,
            f"layer {pending.layer}: no answer from {addresses} within {self.call_timeout_s:g} s "
            "(the call was lost; its streams were reset)",
        )

    def _abandon(self, pending: _Pending) -> None:
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

    def _expert_call(
        self, layer: int, hidden: np.ndarray, ids: np.ndarray, request_ids
    ) -> expert_pb2.ExpertCall:
        call = expert_pb2.ExpertCall(call_id=next(self._call_ids), layer=layer, request_ids=request_ids)
        wire_dtype = tensor_codec.wire_dtype_of(tensor_codec.hidden_dtype_of(hidden))
        tensor_codec.encode_numpy(hidden, wire_dtype, call.hidden)
        tensor_codec.encode_numpy(ids, tensor_pb2.DType.INT32, call.expert_ids)
        return call

    async def _roundtrip(
        self, layer: int, plan: list[_Part], hidden, ids, request_ids, budget_s: float, replies
    ) -> None:
        """Runs on the I/O loop; always answers through `replies`, never raises.
        `budget_s`: what is left of the call's deadline (the frame path may have used some).

        Answers (True, [(mask or None, rows, stats), ...]) or (False, ExpertCallError)."""
        deadline = self.loop.time() + budget_s
        done: list[tuple] = []
        failed_links: set[int] = set()  # out of this call for good, even if they still look up
        try:
            while plan:
                remaining = deadline - self.loop.time()
                if remaining <= 0:
                    raise ExpertCallError(
                        grpc.StatusCode.UNAVAILABLE,
                        f"layer {layer}: no worker answered within {self.call_timeout_s:g} s",
                    )
                # With a replica to fall back on, a silent worker gets half of what is left,
                # so the retry still fits in the call's deadline.
                replicated = self.routes[layer][0].shape[1] > 1
                budget = remaining / 2 if replicated else remaining
                attempt = self._attempt_apart if replicated else self._attempt
                if len(plan) == 1:  # the common case: no gather, no extra task
                    try:
                        outcomes = [await attempt(plan[0], layer, budget, request_ids)]
                    except ExpertCallError as error:
                        outcomes = [error]
                else:
                    outcomes = await asyncio.gather(
                        *(attempt(part, layer, budget, request_ids) for part in plan),
                        return_exceptions=True,
                    )
                failed = []
                for part, outcome in zip(plan, outcomes, strict=True):
                    if isinstance(outcome, BaseException):
                        if not isinstance(outcome, ExpertCallError):
                            raise outcome
                        failed.append((part, outcome))
                    else:
                        done.append((part.mask, *outcome))
                failed_links.update(part.link for part, _ in failed)
                plan = self._replan(layer, failed, hidden, ids, failed_links) if failed else []
            replies.put((True, done))
        except ExpertCallError as error:
            replies.put((False, error))
        except Exception as error:  # noqa: BLE001 - the engine thread must always get an answer
            replies.put(
                (False, ExpertCallError(grpc.StatusCode.INTERNAL, f"layer {layer} call failed: {error!r}"))
            )

    def _replan(
        self, layer: int, failed: list, hidden: np.ndarray, ids: np.ndarray, exclude: set[int]
    ) -> list[_Part]:
        """Move the failed parts' pairs to other live replicas, or raise naming what is missing."""
        pending = np.zeros(ids.shape, dtype=bool)
        for part, error in failed:
            if error.code == grpc.StatusCode.INVALID_ARGUMENT:
                raise error  # our call is malformed: every replica would say the same
            self.links[part.link].retries_metric.inc()
            if part.mask is None:
                pending[:] = True
            else:
                pending |= part.mask
        log.warning(
            "expert_call_retry",
            layer=layer,
            failed=[self.links[part.link].address for part, _ in failed],
            error=str(failed[0][1]),
        )
        owners = np.full(ids.shape, -1, dtype=np.int32)
        try:
            owners[pending] = self._choose(layer, ids[pending], next(self._rotation), tuple(exclude))
        except ExpertCallError as gap:  # name what failed and what is now missing
            causes = "; ".join(dict.fromkeys(str(error) for _, error in failed))
            raise ExpertCallError(grpc.StatusCode.UNAVAILABLE, f"{causes}; {gap}") from None
        return _plan(owners, hidden, ids)

    async def _attempt_apart(self, part: _Part, layer: int, budget_s: float, request_ids) -> tuple:
        """`_attempt` for a replicated layer, where a silent worker's pairs must move on in time: the
        attempt runs as a task of its own and is left behind (cancelled, not awaited) when its
        budget is spent, so the retry never depends on the cancellation reaching an await inside
        gRPC. A full-suite run here once lost such a call: the attempt on a SIGSTOPped replica
        never returned after its cancel, and the other replica was never asked."""
        inner = asyncio.ensure_future(self._attempt(part, layer, budget_s, request_ids))
        done, _ = await asyncio.wait({inner}, timeout=budget_s + ABANDON_AFTER_S)
        if inner in done and not inner.cancelled():
            return inner.result()  # the answer, or the attempt's own ExpertCallError
        self._abandoned.add(inner)  # from now on its own bookkeeping is skipped (see _drop)
        self._deadlines.forget(inner)
        inner.cancel()
        inner.add_done_callback(self._abandoned.discard)
        inner.add_done_callback(lambda task: task.cancelled() or task.exception())  # retrieved
        link = self.links[part.link]
        self._drop(link)
        expert_metrics.WORKER_ERRORS.labels(link.address, "UNAVAILABLE").inc()
        raise ExpertCallError(
            grpc.StatusCode.UNAVAILABLE,
            f"expert worker {link.address} did not answer layer {layer} within {budget_s:.3g} s",
        )

    async def _attempt(self, part: _Part, layer: int, budget_s: float, request_ids) -> tuple:
        link = self.links[part.link]
        link.calls_metric.inc()
        task = asyncio.current_task()
        self._deadlines.watch(task, budget_s)
        try:
            return await self._one(link, layer, part.hidden, part.ids, request_ids)
        except asyncio.CancelledError:
            if not self._deadlines.expired(task):
                raise
            task.uncancel()
            self._drop(link)
            error = ExpertCallError(
                grpc.StatusCode.UNAVAILABLE,
                f"expert worker {link.address} did not answer layer {layer} within {budget_s:.3g} s",
            )
        except ExpertCallError as failure:
            error = failure
        finally:
            self._deadlines.forget(task)
        if task not in self._abandoned:  # (an abandoned attempt was counted when it was left)
            expert_metrics.WORKER_ERRORS.labels(link.address, error.code.name).inc()
        raise error

    def _drop(self, link: WorkerLink, failed: bool = True) -> None:
        """Reset the link's stream (a late reply must not be taken for the next call's) and, when
        `failed`, stop routing to it. Not from an attempt that was abandoned: that was done when it
        was left, and by now the link may carry a newer call's stream."""
        if asyncio.current_task() in self._abandoned:
            return
        link.reset()
        if failed:
            self._link_failed(link)

    async def _one(self, link: WorkerLink, layer: int, hidden: np.ndarray, ids: np.ndarray, request_ids):
        call = self._expert_call(layer, hidden, ids, request_ids)
        try:
            stream = link.open_stream()
            await stream.write(call)
            result = await stream.read()
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as error:
            self._drop(link)
            detail = error.details() if isinstance(error, grpc.aio.AioRpcError) else str(error)
            raise ExpertCallError(
                grpc.StatusCode.UNAVAILABLE, f"expert worker {link.address} is unavailable: {detail}"
            ) from None
        if result is grpc.aio.EOF:
            self._drop(link)
            raise ExpertCallError(
                grpc.StatusCode.UNAVAILABLE, f"expert worker {link.address} closed its stream"
            )
        if result.HasField("error"):
            raise ExpertCallError(
                _status_code(result.error.code), f"expert worker {link.address}: {result.error.message}"
            )
        if result.call_id != call.call_id:
            self._drop(link, failed=False)
            raise ExpertCallError(
                grpc.StatusCode.INTERNAL, f"expert worker {link.address} answered out of order"
            )
        rows = tensor_codec.decode_numpy(result.output, "output", 1 << 40, ndim=2)
        return rows, result.stats

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


def _plan(owners: np.ndarray, hidden: np.ndarray, ids: np.ndarray) -> list[_Part]:
    """Group the pairs by owning link: one part per link with the rows that link must see.
    `owners` is [T, k] (-1 = not part of this plan)."""
    first = int(owners.flat[0])
    if first >= 0 and (owners == first).all():
        return [_Part(first, None, hidden, ids)]
    parts = []
    for link in np.unique(owners).tolist():
        if link < 0:
            continue
        mask = owners == link
        rows = np.flatnonzero(mask.any(axis=1))
        parts.append(_Part(link, mask, hidden[rows], np.where(mask, ids, -1)[rows]))
    return parts


def _status_code(value: int) -> grpc.StatusCode:
    return next(c for c in grpc.StatusCode if c.value[0] == value)


def _new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:  # pragma: no cover
        return asyncio.new_event_loop()
