"""Which worker serves each (layer, expert) pair: the routing table over live replicas, and a
layer call's plan (one part per worker)."""

from __future__ import annotations

import grpc
import numpy as np

from services.common.logging import get_logger
from services.common.ranges import format_ranges
from services.core.expert_link.frame_link import FrameLink
from services.core.expert_link.links import ExpertCallError, WorkerLink
from services.proto.moemesh.v1 import expert_pb2

log = get_logger(__name__)


class CallPart:
    """The pairs of one layer call sent to one worker. `mask` [T, k] marks them (None = all)."""

    __slots__ = ("hidden", "ids", "link", "mask")

    def __init__(self, link: int, mask: np.ndarray | None, hidden: np.ndarray, ids: np.ndarray):
        self.link, self.mask, self.hidden, self.ids = link, mask, hidden, ids


class RoutingMixin:
    """ExpertDispatcher's routing: `routes[layer]` = (replicas [E, R] link indices padded with -1,
    live replica count [E]), swapped whole (never mutated) so the engine thread always reads a
    consistent table; `_sole_owner[layer]` = the one live link holding all of a layer. A link's
    state follows its worker's Describe answers, and the routes follow every change of it."""

    async def _describe(self, link: WorkerLink, timeout_s: float) -> None:
        """Describe one link and mark it up or down; raises a readable error when down."""
        try:
            reply = await link.stub.Describe(self.describe_request, timeout=timeout_s)
        except grpc.aio.AioRpcError as error:
            link.last_error = f"unreachable ({error.code().name}): {error.details()}"
            self._set_link(link, None)
            raise RuntimeError(f"expert worker {link.address} is unreachable: {error.details()}") from None
        if reply.model_fingerprint != self.manifest.fingerprint:
            link.last_error = f"serves another model ({reply.model_fingerprint})"
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
        if describe is not None:
            link.last_describe = describe
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
        """What no live worker serves: one line per set of layers missing the same experts, naming
        the workers that last served them and why they are gone."""
        groups: dict[tuple[tuple[int, ...], str], list[int]] = {}
        for layer, (_, count) in sorted(self.routes.items()):
            missing = np.flatnonzero(count == 0).tolist()
            if missing:
                groups.setdefault((tuple(missing), self._lost_owners(layer, missing)), []).append(layer)
        return [
            f"layer{'s' if len(layers) > 1 else ''} {format_ranges(layers)} experts "
            f"{format_ranges(list(missing))} have no reachable worker{owners}"
            for (missing, owners), layers in groups.items()
        ]

    def _lost_owners(self, layer: int, missing: list[int]) -> str:
        """ " (last served by NAME at ADDRESS: why)" for the down workers that held some of
        `missing` in `layer`; the down workers that never answered when no worker is known to."""
        wanted, lost, silent = set(missing), [], []
        for link in self.links:
            if link.up:
                continue
            why = f": {link.last_error}" if link.last_error else ""
            if link.last_describe is None:
                silent.append(f"{link.address}{why}")
                continue
            held = next((le for le in link.last_describe.layers if le.layer == layer), None)
            if held is not None and wanted & set(held.experts):
                name = link.last_describe.worker_id
                lost.append(
                    f"{name} at {link.address}{why}" if name and name != link.address else link.address + why
                )
        if lost:
            return f" (last served by {'; '.join(lost)})"
        return f" (workers that never answered: {'; '.join(silent)})" if silent else ""

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
                f"layer {layer} experts {format_ranges(missing)} have no reachable worker"
                + self._lost_owners(layer, missing),
            )
        if replicas.shape[1] == 1:
            return replicas[ids, 0]
        return replicas[ids, (ids + rotation) % counts]


def plan_parts(owners: np.ndarray, hidden: np.ndarray, ids: np.ndarray) -> list[CallPart]:
    """Group the pairs by owning link: one part per link with the rows that link must see.
    `owners` is [T, k] (-1 = not part of this plan)."""
    first = int(owners.flat[0])
    if first >= 0 and (owners == first).all():
        return [CallPart(first, None, hidden, ids)]
    parts = []
    for link in np.unique(owners).tolist():
        if link < 0:
            continue
        mask = owners == link
        rows = np.flatnonzero(mask.any(axis=1))
        parts.append(CallPart(link, mask, hidden[rows], np.where(mask, ids, -1)[rows]))
    return parts
