"""A worker's end of the in-graph expert data plane (services/common/data_plane.py).

On a thread of its own, the worker joins core's `mx.distributed` group and answers every layer
call core makes over it: it waits for the header, then builds that call's exchange and rows as
one graph, which is evaluated with the next header, so the worker synchronises once per layer
call. Each pair whose rank is this worker's is computed; every other pair gives zeros. A layer
whose experts are resident and computed by MLX joins the graph (the mlx-lm module on local
rows); a streamed layer, or one on the CPU kernel, evaluates the call's inputs and computes
them on the host, as a gRPC call would.

The group is trusted (its members are the cluster's own processes): a call this worker cannot
compute is logged and answered with zeros, since a collective cannot be refused in-band.
"""

from __future__ import annotations

import threading
import time

import mlx.core as mx
import numpy as np

from services.common import data_plane as wire
from services.common import tensor_codec
from services.common.logging import get_logger
from services.experts.compute import ExpertCompute

log = get_logger(__name__)
ANSWER_FIRST_S = 0.2


class DataPlaneWorker:
    def __init__(self, compute: ExpertCompute, backend: str):
        self.compute = compute
        self.backend = backend
        self.rank = 0  # set once the group has formed: Describe reports it
        self.calls = 0
        self.group: mx.distributed.Group | None = None
        self._slots: dict[int, mx.array] = {}  # layer -> local row per global expert id (-1: not held)
        self._thread = threading.Thread(target=self._run, name="data-plane", daemon=True)
        self._starting = threading.Lock()
        self._tried = False

    def start(self) -> None:
        """Join core's group (on core's Describe asking it to), once."""
        with self._starting:
            if not self._tried:
                self._tried = True
                self._thread.start()

    def _run(self) -> None:
        time.sleep(ANSWER_FIRST_S)  # joining holds the interpreter: let Describe's answer go first
        try:
            group = wire.join_group(self.backend, on_joined=self._joined)
        except wire.DataPlaneError as error:
            log.error("data_plane_unavailable", error=str(error))
            return
        log.info("data_plane_joined", backend=self.backend, rank=self.rank, size=group.size())
        try:
            self._serve()
        except RuntimeError as error:  # core or another member went away
            log.warning("data_plane_lost", error=str(error), calls=self.calls, shut=wire.abort_ring_sockets())
        self.rank = 0

    def _joined(self, group: mx.distributed.Group) -> None:
        """In the group: Describe reports the rank from now on (core reads it once formed)."""
        self.group = group
        self.rank = group.rank()

    def _serve(self) -> None:
        # Collectives on a stream of their own: one left waiting on a lost member must not hold
        # up the gRPC calls this worker then serves (each MLX stream runs on its own thread).
        stream = mx.new_stream(mx.gpu if self.backend == "nccl" else mx.cpu)
        rows = None
        while True:
            header = mx.distributed.all_sum(
                wire.after(mx.zeros((wire.HEADER_LEN,), dtype=mx.int32), rows),
                group=self.group,
                stream=stream,
            )
            command, layer, tokens, top_k, width, code = header.tolist()  # also sends the last rows
            if command != wire.CALL:
                log.info("data_plane_stopped", calls=self.calls)
                return
            dtype = wire.DTYPES[code]
            words = wire.state_words(tokens, width, dtype) + 2 * tokens * top_k
            got = mx.distributed.all_sum(
                mx.depends(mx.zeros((words,), dtype=mx.uint32), header), group=self.group, stream=stream
            )
            states, ids, ranks = wire.unpack_inputs(got, tokens, top_k, width, dtype)
            try:
                out = self.rows(layer, states, ids, ranks == self.rank)
            except Exception:  # see the module docstring: the call still completes, with zeros
                log.exception("data_plane_call_failed", layer=layer, tokens=tokens)
                out = None
            if out is None:
                out = mx.depends(mx.zeros((tokens, top_k, width), dtype=dtype), got)
            rows = mx.distributed.all_sum(out.astype(dtype), group=self.group, stream=stream)
            self.calls += 1

    def rows(self, layer: int, states: mx.array, ids: mx.array, mine: mx.array) -> mx.array | None:
        """[T, k, H]: this worker's pairs' rows, zeros elsewhere; None when it holds none of the layer."""
        compute = self.compute
        if layer not in compute.store.owned:
            return None
        slots = self._slot_table(layer)
        if slots is not None:
            local = slots[ids]
            mine = mine & (local >= 0)
            out = compute.module(layer)(states, mx.where(mine, local, 0))
            return mx.where(mine[..., None], out, mx.zeros_like(out))
        wire_states = tensor_codec.wire_form(states)
        mx.eval(wire_states, ids, mine)  # streamed experts or the CPU kernel: computed on the host
        hidden, asked = np.asarray(wire_states), np.asarray(mine)
        tokens, top_k = asked.shape
        reply = np.zeros((tokens * top_k, hidden.shape[1]), dtype=hidden.dtype)
        if asked.any():
            host_ids = np.where(asked, np.asarray(ids), -1)
            reply[np.flatnonzero(asked.ravel())] = compute.compute_rows(
                layer, hidden, host_ids, asked, int(asked.sum())
            )
        return tensor_codec.to_mlx(reply).reshape(tokens, top_k, hidden.shape[1])

    def _slot_table(self, layer: int) -> mx.array | None:
        """Global expert id -> local row, where the layer can be computed inside the graph."""
        table = self._slots.get(layer)
        if table is None and self.compute.in_graph_rows(layer):  # a resident store: rows never move
            table = self._slots[layer] = mx.array(self.compute.store.load(layer, []).astype(np.int32))
        return table
