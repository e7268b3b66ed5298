"""Core's end of the in-graph expert data plane (services/common/data_plane.py has the contract).

A MoE layer whose experts all have a holder in core's `mx.distributed` group is computed by
`DistributedExperts`: the layer's exchange joins the model's graph as three collectives, and
core evaluates once per forward, as monolithic mlx-lm does. gRPC stays the control plane
(Describe, health, stats) and the fallback: a layer some expert of which has no holder in the
group, and every layer once the group has lost a member, goes through the dispatcher's gRPC or
frame links (`RemoteExperts`), with their replicas and failover.

A group cannot re-form in a running process, so a lost member turns the plane off until core
restarts. The step that was running when it was lost fails (its requests get UNAVAILABLE) and
the next steps use gRPC, or, where MLX leaves that step blocked, core exits (`DataPlane._watch`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
from collections.abc import Callable

import grpc
import mlx.core as mx
import numpy as np
from mlx import nn

from services.common import data_plane as wire
from services.common.data_plane_flag import DATA_PLANE_STUCK
from services.common.logging import get_logger
from services.core.expert_link.dispatcher import ExpertDispatcher
from services.core.expert_link.proxy import RemoteExperts
from services.core.expert_link.step_merge import expert_call
from services.proto.moemesh.v1 import expert_pb2

log = get_logger(__name__)
WATCH_INTERVAL_S = 1.0
WATCH_TIMEOUT_S = 2.0
STOPPED = "stopped"
HEADER_CACHE = 4096  # distinct (layer, tokens, k, width, dtype) headers kept as device arrays
BACKEND_ERROR_TAGS = ("[ring]", "[nccl]", "[jaccl]", "[mpi]", "[distributed]")


class DataPlane:
    """The group, which rank computes each (layer, expert), and the chain of collectives."""

    def __init__(self, dispatcher: ExpertDispatcher, backend: str, stuck_s: float = 60.0):
        """`stuck_s`: how long a step may run once the plane has lost a member (see `_watch`)."""
        self.group: mx.distributed.Group | None = None  # formed by `probe`
        self.backend = backend
        self.stuck_s = stuck_s
        self.dispatcher = dispatcher
        dispatcher.describe_request.join_data_plane = True
        self.lost: str | None = None  # why the plane is off: a member lost, or no group formed
        self._last: mx.array | None = None  # the latest collective: the next one waits for it
        self._headers: dict[tuple, mx.array] = {}
        self._routes_seen = None
        self._ranks: dict[int, mx.array] = {}  # layer -> rank per expert, for layers it covers
        self._members: list = []  # the links in the group
        self._stream: mx.Stream | None = None  # where the collectives run, once formed
        self._asked: set[str] = set()  # workers that have answered a request to join

    def probe(self) -> list[str]:
        """The engine's probe: describe the workers (asking them to join the group), and form the
        group once they all answer. Gives the dispatcher's problems (empty: every expert served)."""
        problems = self.dispatcher.discover()
        if self.group is not None or self.lost is not None:
            return problems
        # A worker that was asked joins at once and, while MLX connects, answers nothing: wait
        # until every worker has been asked, not until every worker answers at the same time.
        links = self.dispatcher.links
        self._asked |= {link.address for link in links if link.up}
        if len(self._asked) < len(links):
            return problems
        try:
            self.group = wire.join_group(self.backend)
        except wire.DataPlaneError as error:
            self.lost = str(error)
            log.warning("data_plane_unavailable", backend=self.backend, reason=self.lost, fallback="grpc")
            return problems
        if self.group.rank() != wire.CORE_RANK:
            self.lost = (
                f"core must be rank {wire.CORE_RANK} of the group, MLX_RANK makes it {self.group.rank()}"
            )
            log.error("data_plane_unavailable", backend=self.backend, reason=self.lost, fallback="grpc")
            return problems
        # Collectives on a stream of their own: one left waiting on a lost member (work MLX had
        # started ahead, say) holds up only what depends on it, not the steps that follow.
        self._stream = mx.new_stream(mx.gpu if self.backend == "nccl" else mx.cpu)
        log.info("data_plane_formed", backend=self.backend, size=self.group.size())
        return self.dispatcher.discover()  # again: the members' answers now carry their ranks

    def ranks_for(self, layer: int) -> mx.array | None:
        """Rank per expert of `layer` when the plane can carry the layer now, else None."""
        if self.lost is not None or self.group is None:
            return None
        routes = self.dispatcher.routes
        if routes is not self._routes_seen:  # the links changed: re-read who is in the group
            self._rebuild()
            self._routes_seen = routes
        if not all(link.up for link in self._members):
            return None
        return self._ranks.get(layer)

    def _rebuild(self) -> None:
        members = [
            link
            for link in self.dispatcher.links
            if link.describe is not None and link.describe.data_plane_rank > 0
        ]
        holders: dict[int, np.ndarray] = {}
        for link in members:
            rank = link.describe.data_plane_rank
            for held in link.describe.layers:
                layer = self.dispatcher.manifest.layer(held.layer)
                ranks = holders.setdefault(held.layer, np.full(layer.num_experts, np.iinfo(np.int32).max))
                experts = np.asarray(held.experts, dtype=np.int64)
                ranks[experts] = np.minimum(ranks[experts], rank)  # a replicated expert: lowest rank
        self._members = members
        self._ranks = {
            layer: mx.array(ranks.astype(np.int32))
            for layer, ranks in holders.items()
            if (ranks < np.iinfo(np.int32).max).all()
        }
        log.info(
            "data_plane_routes",
            backend=self.backend,
            members=[link.address for link in members],
            layers=len(self._ranks),
        )

    # Inside an engine step every forward's call of a layer joins one exchange (step_merge.py),
    # without evaluating anything: the inputs stay lazy, in the graph.
    needs_evaluated_inputs = False

    def call_overlapped(self, layer: int, states: mx.array, ids: mx.array) -> mx.array:
        """The layer's rows [T, k, H] for states [T, H] and int32 top-k ids [T, k], as three
        collectives in the graph (services/common/data_plane.py); nothing is evaluated."""
        tokens, width = states.shape
        top_k = ids.shape[-1]
        header = self._header(layer, tokens, top_k, width, states.dtype)
        group, stream = self.group, self._stream
        header = mx.distributed.all_sum(wire.after(header, self._last), group=group, stream=stream)
        packed = wire.pack_inputs(states, ids, self._ranks[layer][ids])
        sent = mx.distributed.all_sum(mx.depends(packed, header), group=group, stream=stream)
        rows = mx.distributed.all_sum(
            mx.depends(mx.zeros((tokens, top_k, width), dtype=states.dtype), sent), group=group, stream=stream
        )
        self._last = rows
        return rows

    def _header(self, layer: int, tokens: int, top_k: int, width: int, dtype: mx.Dtype) -> mx.array:
        key = (layer, tokens, top_k, width, dtype)
        header = self._headers.get(key)
        if header is None:  # arrays made from host memory are slow to first use on a GPU: keep them
            if len(self._headers) >= HEADER_CACHE:
                self._headers.pop(next(iter(self._headers)))
            values = [wire.CALL, layer, tokens, top_k, width, wire.DTYPES.index(dtype)]
            header = self._headers[key] = mx.array(values, dtype=mx.int32)
            mx.eval(header)
        return header

    def owns_error(self, error: BaseException) -> bool:
        """Whether a step's failure came from the group (then the plane is off from now on)."""
        if not isinstance(error, RuntimeError) or not any(tag in str(error) for tag in BACKEND_ERROR_TAGS):
            return False
        self._lose(str(error))
        return True

    def _lose(self, reason: str) -> None:
        """Turn the plane off for good (once): every later call goes over gRPC."""
        if self.lost is not None:
            return
        self.lost, self._last = reason, None
        shut = wire.abort_ring_sockets()  # the members left waiting on core fail over too
        log.error("data_plane_lost", backend=self.backend, error=reason, fallback="grpc", shut=shut)

    def step_failure(self, default: Callable) -> Callable:
        """The engine's step_failure, knowing that a lost member fails the step UNAVAILABLE."""

        def classify(error: Exception) -> tuple[grpc.StatusCode, str]:
            if self.owns_error(error):
                return grpc.StatusCode.UNAVAILABLE, f"the expert data plane lost a member ({error}); retry"
            return default(error)

        return classify

    def watch(self, busy_since: Callable[[], float | None]) -> None:
        """Watch the members over gRPC while the plane is on (see `_watch`); `busy_since` gives
        since when the engine's thread has been working (None: it waits)."""
        threading.Thread(target=self._watch, args=(busy_since,), name="data-plane-watch", daemon=True).start()

    def _watch(self, busy_since: Callable[[], float | None]) -> None:
        """A member that stops answering turns the plane off before the next step meets it.
        When a member dies mid-step, MLX's ring may raise or may leave the collective blocked
        for ever, and with it any later evaluation that depends on it; nothing can interrupt that,
        so engine work (a step, or taking in a request) that runs past `stuck_s` once the plane is
        off makes core exit, for its supervisor to start it again, rather than hang its requests."""
        while self.lost is None:
            time.sleep(WATCH_INTERVAL_S)
            if self.group is None:
                continue
            try:
                gone = [link.address for link in self._members if not self._answers(link)]
                if gone:
                    self._lose(f"members {gone} stopped answering")
            except Exception:
                log.exception("data_plane_watch_failed")
        while True:
            time.sleep(WATCH_INTERVAL_S)
            began = busy_since()
            if began is not None and time.perf_counter() - began > self.stuck_s:
                seconds = round(time.perf_counter() - began, 1)
                log.critical("data_plane_stuck", seconds=seconds, exit_code=DATA_PLANE_STUCK)
                os._exit(DATA_PLANE_STUCK)

    def _answers(self, link) -> bool:
        async def describe():
            await link.stub.Describe(expert_pb2.DescribeRequest(), timeout=WATCH_TIMEOUT_S)

        try:
            asyncio.run_coroutine_threadsafe(describe(), self.dispatcher.loop).result(WATCH_TIMEOUT_S + 1)
        except grpc.aio.AioRpcError as error:
            return error.code() != grpc.StatusCode.UNAVAILABLE  # anything else: alive, if slow
        except (TimeoutError, concurrent.futures.TimeoutError):
            return True  # busy, not gone
        return True

    def stop(self) -> None:
        """Tell the workers the plane is closing (core exits); they then serve gRPC only."""
        if self.lost is not None or self.group is None:
            return
        header = mx.array([wire.STOP, 0, 0, 0, 0, 0], dtype=mx.int32)
        try:
            mx.eval(
                mx.distributed.all_sum(wire.after(header, self._last), group=self.group, stream=self._stream)
            )
        except RuntimeError as error:  # a member already gone: nothing to tell it
            log.warning("data_plane_stop_failed", error=str(error))
        self.lost = STOPPED


class DistributedExperts(nn.Module):
    """A MoE layer's routed experts over the data plane, or over gRPC when the plane cannot
    carry the layer (see the module docstring)."""

    def __init__(self, layer: int, plane: DataPlane):
        super().__init__()
        self._layer = layer
        self._plane = plane
        self._fallback = RemoteExperts(layer, plane.dispatcher)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        if self._plane.ranks_for(self._layer) is None or not wire.packable(x.shape[-1], x.dtype):
            return self._fallback(x, indices)
        width, top_k = x.shape[-1], indices.shape[-1]
        states, ids = x.reshape(-1, width), indices.reshape(-1, top_k).astype(mx.int32)
        return expert_call(self._plane, self._layer, states, ids).reshape(*indices.shape, width)
