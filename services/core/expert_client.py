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
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections import deque

import grpc
import mlx.core as mx
import numpy as np

from services.common import tensor_codec
from services.common.grpc_util import channel_options, normalize_address
from services.common.manifest import Manifest
from services.common.ranges import format_ranges
from services.proto.moemesh.v1 import expert_pb2, expert_pb2_grpc, tensor_pb2


class ExpertCallError(RuntimeError):
    """A layer call failed. `code` is the grpc.StatusCode the request should fail with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class LayerCallTimings:
    """Per layer call, in microseconds, over a sliding window: where the time goes.

    Written by the engine thread, read by the servicer thread, hence the lock.
    """

    def __init__(self, window: int = 8192):
        self._lock = threading.Lock()
        self._calls: deque[tuple[float, float, float]] = deque(maxlen=window)  # (total, worker, compute)

    def record(self, total: float, worker: float, compute: float) -> None:
        with self._lock:
            self._calls.append((total, worker, compute))

    def snapshot(self, reset: bool = False) -> np.ndarray:
        """[n, 3] array of (total, worker, compute) microseconds."""
        with self._lock:
            rows = np.array(self._calls, dtype=np.float64).reshape(-1, 3)
            if reset:
                self._calls.clear()
        return rows

    def __len__(self) -> int:
        return len(self._calls)


class WorkerLink:
    """One worker: its channel and its long-lived Forward stream (recreated after a failure)."""

    def __init__(self, address: str, max_message_bytes: int):
        self.address = normalize_address(address)
        self.channel = grpc.aio.insecure_channel(self.address, options=channel_options(max_message_bytes))
        self.stub = expert_pb2_grpc.ExpertWorkerStub(self.channel)
        self.stream: grpc.aio.StreamStreamCall | None = None
        self.describe: expert_pb2.DescribeResponse | None = None

    def open_stream(self) -> grpc.aio.StreamStreamCall:
        if self.stream is None or self.stream.done():
            self.stream = self.stub.Forward()
        return self.stream

    def reset(self) -> None:
        if self.stream is not None:
            self.stream.cancel()
        self.stream = None


class ExpertDispatcher:
    """Routes every (token, expert) pair of a layer call to the worker that owns the expert."""

    def __init__(
        self,
        manifest: Manifest,
        worker_addresses: list[str],
        call_timeout_s: float = 60.0,
        max_message_bytes: int = 512 * 1024 * 1024,
    ):
        if not worker_addresses:
            raise ValueError("at least one expert worker address is needed")
        self.manifest = manifest
        self.call_timeout_s = call_timeout_s
        # The I/O loop and its thread. Channels are created inside the loop (see _discover)
        # so they bind to it and to no other loop.
        self.loop = _new_event_loop()
        self._io_thread = threading.Thread(target=self.loop.run_forever, name="expert-io", daemon=True)
        self._io_thread.start()
        self._replies: queue.SimpleQueue = queue.SimpleQueue()
        self._addresses = list(worker_addresses)
        self._max_message_bytes = max_message_bytes
        self.links: list[WorkerLink] = []
        # owner[layer][expert] = index into self.links, -1 = nobody
        self.owner: dict[int, np.ndarray] = {
            layer.layer: np.full(layer.num_experts, -1, dtype=np.int32) for layer in manifest.layers
        }
        self.hidden_dtype = tensor_codec.MLX_DTYPE_BY_NAME[manifest.dtype]
        self.timings = LayerCallTimings()
        self._call_ids = itertools.count(1)

    # ---- placement -------------------------------------------------------------------------

    def discover(self, timeout_s: float = 5.0) -> list[str]:
        """Describe every worker, build the owner table; return problems (empty = all covered)."""
        return asyncio.run_coroutine_threadsafe(self._discover(timeout_s), self.loop).result()

    async def _discover(self, timeout_s: float) -> list[str]:
        if not self.links:
            self.links = [WorkerLink(address, self._max_message_bytes) for address in self._addresses]
        problems = []
        for table in self.owner.values():
            table.fill(-1)
        replies = await asyncio.gather(
            *(link.stub.Describe(expert_pb2.DescribeRequest(), timeout=timeout_s) for link in self.links),
            return_exceptions=True,
        )
        for index, (link, reply) in enumerate(zip(self.links, replies, strict=True)):
            if isinstance(reply, BaseException):
                link.describe = None
                detail = reply.details() if isinstance(reply, grpc.aio.AioRpcError) else repr(reply)
                problems.append(f"expert worker {link.address} is unreachable: {detail}")
                continue
            if reply.model_fingerprint != self.manifest.fingerprint:
                problems.append(
                    f"expert worker {link.address} serves model {reply.model_fingerprint}, core has {self.manifest.fingerprint}"
                )
                continue
            link.describe = reply
            for held in reply.layers:
                table = self.owner.get(held.layer)
                if table is not None:
                    experts = np.array(held.experts, dtype=np.int64)
                    free = experts[table[experts] < 0]  # first owner wins; replicas are a later feature
                    table[free] = index
        problems.extend(self.coverage_gaps())
        return problems

    def coverage_gaps(self) -> list[str]:
        gaps = []
        for layer, table in self.owner.items():
            missing = np.flatnonzero(table < 0).tolist()
            if missing:
                gaps.append(f"layer {layer} experts {format_ranges(missing)} have no reachable worker")
        return gaps

    # ---- the layer call ----------------------------------------------------------------------

    def call(self, layer: int, hidden: mx.array, expert_ids: mx.array) -> mx.array:
        """hidden [T, H] in the model dtype or its wire form, expert_ids [T, k] int32, both
        evaluated -> [T, k, H] in the model dtype."""
        started = time.perf_counter()
        tokens, k = expert_ids.shape
        ids = np.asarray(expert_ids)  # evaluated int32 (RemoteExperts made it so): a view, no sync
        owners = self.owner[layer][ids]
        if owners.min() < 0:
            missing = sorted(set(ids[owners < 0].tolist()))
            raise ExpertCallError(
                grpc.StatusCode.UNAVAILABLE,
                f"layer {layer} experts {format_ranges(missing)} have no reachable worker",
            )
        host_hidden = tensor_codec.numpy_view(hidden)
        wire_dtype = tensor_codec.wire_dtype_of(self.hidden_dtype)
        first = int(owners.flat[0])
        if (owners == first).all():
            plan = [(first, None, host_hidden, ids)]
        else:
            plan = []
            for worker in np.unique(owners).tolist():
                mask = owners == worker
                rows = np.flatnonzero(mask.any(axis=1))
                plan.append((worker, mask, host_hidden[rows], np.where(mask, ids, -1)[rows]))
        self.loop.call_soon_threadsafe(self._start_roundtrip, layer, plan, wire_dtype)
        ok, results = self._replies.get()
        if not ok:
            raise results

        hidden_size = hidden.shape[-1]
        if len(plan) == 1:
            out = results[0][0].reshape(tokens, k, hidden_size)
        else:
            out = np.empty((tokens * k, hidden_size), dtype=host_hidden.dtype)
            for (_, mask, _, _), (rows, _) in zip(plan, results, strict=True):
                out[np.flatnonzero(mask)] = rows
            out = out.reshape(tokens, k, hidden_size)
        array = mx.array(out)
        if self.hidden_dtype == mx.bfloat16:
            array = array.view(mx.bfloat16)
        worker_us = max(r[1].decode_us + r[1].compute_us + r[1].encode_us for r in results)
        compute_us = max(r[1].compute_us for r in results)
        self.timings.record((time.perf_counter() - started) * 1e6, worker_us, compute_us)
        return array

    def _start_roundtrip(self, layer: int, plan, wire_dtype: int) -> None:
        self.loop.create_task(self._roundtrip(layer, plan, wire_dtype))

    async def _roundtrip(self, layer: int, plan, wire_dtype: int) -> None:
        """Runs on the I/O loop; always answers through self._replies, never raises."""
        links = [self.links[worker] for worker, _, _, _ in plan]
        try:
            # asyncio.timeout, not wait_for: no extra task per await on the hot path.
            async with asyncio.timeout(self.call_timeout_s):
                if len(plan) == 1:
                    _, _, hidden, ids = plan[0]
                    results = [await self._one(links[0], layer, hidden, ids, wire_dtype)]
                else:
                    results = await asyncio.gather(
                        *(
                            self._one(link, layer, hidden, ids, wire_dtype)
                            for link, (_, _, hidden, ids) in zip(links, plan, strict=True)
                        )
                    )
            self._replies.put((True, results))
        except TimeoutError:
            for link in links:
                link.reset()  # a late reply must not be taken for the next call's
            names = ", ".join(link.address for link in links)
            self._replies.put(
                (
                    False,
                    ExpertCallError(
                        grpc.StatusCode.UNAVAILABLE,
                        f"expert worker {names} did not answer layer {layer} within {self.call_timeout_s:g} s",
                    ),
                )
            )
        except ExpertCallError as error:
            self._replies.put((False, error))
        except Exception as error:  # noqa: BLE001 - the engine thread must always get an answer
            self._replies.put(
                (False, ExpertCallError(grpc.StatusCode.INTERNAL, f"layer {layer} call failed: {error!r}"))
            )

    async def _one(self, link: WorkerLink, layer: int, hidden: np.ndarray, ids: np.ndarray, wire_dtype: int):
        call = expert_pb2.ExpertCall(call_id=next(self._call_ids), layer=layer)
        tensor_codec.encode_numpy(hidden, wire_dtype, call.hidden)
        tensor_codec.encode_numpy(ids, tensor_pb2.DType.INT32, call.expert_ids)
        try:
            stream = link.open_stream()
            await stream.write(call)
            result = await stream.read()
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as error:
            link.reset()
            detail = error.details() if isinstance(error, grpc.aio.AioRpcError) else str(error)
            raise ExpertCallError(
                grpc.StatusCode.UNAVAILABLE, f"expert worker {link.address} is unavailable: {detail}"
            ) from None
        if result is grpc.aio.EOF:
            link.reset()
            raise ExpertCallError(
                grpc.StatusCode.UNAVAILABLE, f"expert worker {link.address} closed its stream"
            )
        if result.HasField("error"):
            raise ExpertCallError(
                grpc.StatusCode(next(c for c in grpc.StatusCode if c.value[0] == result.error.code)),
                f"expert worker {link.address}: {result.error.message}",
            )
        if result.call_id != call.call_id:
            link.reset()
            raise ExpertCallError(
                grpc.StatusCode.INTERNAL, f"expert worker {link.address} answered out of order"
            )
        rows = tensor_codec.decode_numpy(result.output, "output", 1 << 40, ndim=2)
        return rows, result.stats

    def close(self) -> None:
        async def _close():
            for link in self.links:
                link.reset()
                await link.channel.close()

        asyncio.run_coroutine_threadsafe(_close(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._io_thread.join(timeout=10)


def _new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:  # pragma: no cover
        return asyncio.new_event_loop()
