"""The pieces of core's expert links that every data path shares: a worker link, the call's
error, its timings, and the ExpertCall message."""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import os
import socket
import threading
from collections import deque

import grpc
import numpy as np

from services.common import tensor_codec
from services.common.grpc_util import aio_channel, normalize_address
from services.common.logging import REQUEST_ID_METADATA_KEY
from services.common.tls import TlsFiles
from services.core.expert_link import metrics as expert_metrics
from services.core.expert_link.frame_link import FrameLink
from services.proto.moemesh.v1 import expert_pb2, expert_pb2_grpc, tensor_pb2

# The request ids of the batch being stepped, set by the engine thread before each step
# (the layer calls run on that same thread); they ride in every ExpertCall for worker logs.
BATCH_REQUEST_IDS: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar(
    "batch_request_ids", default=()
)
# The parts a remote layer call is timed in, in order (LayerCallTimings.record_parts): core's
# evaluation before the hop, then the call itself, encode through core_decode. send and reply
# are recorded on same-host frame links only, where core and worker share a clock.
HOP_PARTS = (
    "core_sync",
    "encode",
    "send",
    "worker_decode",
    "worker_compute",
    "worker_encode",
    "reply",
    "core_decode",
)
CORE_LINK_ID = f"core-{socket.gethostname()}-{os.getpid()}"
_CALL_IDS = itertools.count(1)  # unique on every link, whichever path carries the call


class ExpertCallError(RuntimeError):
    """A layer call failed. `code` is the grpc.StatusCode the request should fail with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class LayerCallTimings:
    """Per layer call, in microseconds, over a sliding window: where the time goes.

    `record` keeps each call's (total, worker, compute); `record_part` the parts of a call and
    of the engine step around it, by name (core_sync, encode, send, worker_decode,
    worker_compute, worker_encode, reply, core_decode, engine_step). Written by the engine
    thread, read by the servicer thread, hence the lock.
    """

    def __init__(self, window: int = 8192):
        self._lock = threading.Lock()
        self._window = window
        self._calls: deque[tuple[float, float, float]] = deque(maxlen=window)  # (total, worker, compute)
        self._parts: dict[str, deque[float]] = {}
        self._by_layer: dict[int, deque[float]] = {}  # each layer's recent call totals

    def record(self, total: float, worker: float, compute: float, layer: int) -> None:
        with self._lock:
            self._calls.append((total, worker, compute))
            window = self._by_layer.get(layer)
            if window is None:
                window = self._by_layer[layer] = deque(maxlen=512)
            window.append(total)

    def by_layer(self) -> dict[int, np.ndarray]:
        """Each layer's recent call totals in microseconds (not cleared by `reset`)."""
        with self._lock:
            return {layer: np.array(values, dtype=np.float64) for layer, values in self._by_layer.items()}

    def record_part(self, name: str, microseconds: float) -> None:
        self.record_parts({name: microseconds})

    def record_parts(self, parts: dict[str, float]) -> None:
        """Several parts under one lock (a layer call records all of its own at once)."""
        with self._lock:
            for name, microseconds in parts.items():
                values = self._parts.get(name)
                if values is None:
                    values = self._parts[name] = deque(maxlen=self._window)
                values.append(microseconds)

    def record_call_parts(self, pending, stats, one_clock: bool, arrived, arrived_ns, finished) -> None:
        """A finished layer call's parts (`pending` a PendingCall, `stats` each worker's CallStats;
        the slowest worker's where several answered). Send and reply need `one_clock`: core and
        worker on one host, reading one monotonic clock."""
        parts = {
            "encode": (pending.sent - pending.started) * 1e6,
            "core_decode": (finished - arrived) * 1e6,
            **{
                f"worker_{n}": max(getattr(s, f"{n}_us") for s in stats)
                for n in ("decode", "compute", "encode")
            },
        }
        if one_clock and all(s.started_ns for s in stats):
            parts["send"] = (max(s.started_ns for s in stats) - pending.sent_ns) / 1e3
            parts["reply"] = (arrived_ns - max(s.finished_ns for s in stats)) / 1e3
        self.record_parts(parts)

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
        # What the worker last said it holds: kept while it is down, to name what went with it.
        self.last_describe: expert_pb2.DescribeResponse | None = None
        self.last_error = ""
        self.calls = self.errors = self.retries = 0  # for the status page (the metrics have them too)
        self._calls_metric = expert_metrics.WORKER_CALLS.labels(self.address)
        self._retries_metric = expert_metrics.WORKER_RETRIES.labels(self.address)
        self.up_metric = expert_metrics.WORKER_UP.labels(self.address)
        self.up_metric.set(0)

    def count_call(self) -> None:
        self.calls += 1
        self._calls_metric.inc()

    def count_retry(self) -> None:
        self.retries += 1
        self._retries_metric.inc()

    def count_error(self, code: grpc.StatusCode, message: str = "") -> None:
        """A call to this worker failed with `code`; `message` says how (kept as its last error)."""
        self.errors += 1
        expert_metrics.WORKER_ERRORS.labels(self.address, code.name).inc()
        self.last_error = message or code.name

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


def expert_call_message(
    layer: int, hidden: np.ndarray, ids: np.ndarray, request_ids
) -> expert_pb2.ExpertCall:
    """The ExpertCall for hidden [T, H] (wire form) and ids [T, k] int32, with a fresh call id."""
    call = expert_pb2.ExpertCall(call_id=next(_CALL_IDS), layer=layer, request_ids=request_ids)
    wire_dtype = tensor_codec.wire_dtype_of(tensor_codec.hidden_dtype_of(hidden))
    tensor_codec.encode_numpy(hidden, wire_dtype, call.hidden)
    tensor_codec.encode_numpy(ids, tensor_pb2.DType.INT32, call.expert_ids)
    return call


def status_code(value: int) -> grpc.StatusCode:
    return next(c for c in grpc.StatusCode if c.value[0] == value)
