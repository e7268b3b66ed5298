"""Validate an ExpertCall and run it through the model's own mlx-lm expert module.

Each served layer gets the architecture's SwitchGLU/SwitchMLP (built by mlx-lm,
quantized the way mlx-lm would for these weights) loaded with only the owned
experts, so global expert ids are mapped to local rows. Everything a call carries
is checked before any math; a failed check raises `CallRejected` naming the field,
which the servicer returns as INVALID_ARGUMENT without touching the stream.

Where MLX computes on the CPU and a layer's module is a quantized SwitchGLU, the layer is
computed by metal/experts_cpu.c instead (same numbers to float32 rounding, 8-19x faster than
MLX's CPU quantized matmul), on the module's own weight memory; `kernel="mlx"` turns it off.
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np
from mlx import nn
from mlx.utils import tree_unflatten

from metal.experts_cpu import KERNELS, SwitchGLUKernel, default_threads
from services.common import tensor_codec
from services.common.manifest import Manifest
from services.common.model_build import TensorSpec, build_skeleton, expert_width, quantize_like_mlx_lm
from services.common.module_paths import find_module
from services.common.tensor_codec import TensorDecodeError
from services.experts.store import ExpertStore, ResidentExpertStore
from services.proto.moemesh.v1 import expert_pb2, tensor_pb2

DEFAULT_MAX_CALL_BYTES = 256 * 1024 * 1024
# multiply-adds a CPU kernel thread should have before another one is worth starting: threads start
# per call (tens of microseconds each); a one-token call of the demo model is 2.7 M in all, of a
# Qwen3-30B-A3B-shaped layer 38 M (0.32 and ~4 ms on one thread; bench/expert_kernel.py)
MACS_PER_THREAD = 4_000_000
HIDDEN_WIRE_DTYPES = (tensor_pb2.DType.FLOAT32, tensor_pb2.DType.FLOAT16, tensor_pb2.DType.BFLOAT16)


class CallRejected(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class ExpertCompute:
    def __init__(
        self,
        store: ExpertStore,
        max_call_bytes: int = DEFAULT_MAX_CALL_BYTES,
        kernel: str = "auto",
        threads: int | None = None,
    ):
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        self.store = store
        self.manifest: Manifest = store.manifest
        self.max_call_bytes = max_call_bytes
        self._modules: dict[int, nn.Module] = {}
        self._widths: dict[int, int] = {}  # what each layer's experts take: hidden (or latent) size
        self._local_index: dict[int, np.ndarray] = {}
        self._kernels: dict[int, SwitchGLUKernel] = {}
        self.threads = max(1, threads or default_threads())
        self.macs_per_thread = MACS_PER_THREAD
        use_kernel = kernel == "auto" and mx.default_device() == mx.cpu
        skeleton = build_skeleton(self.manifest.config)
        served = [self.manifest.layer(index) for index in store.owned]
        specs = {
            f"{layer.module}.{t.name}": TensorSpec((layer.num_experts, *t.shape), t.mlx_dtype)
            for layer in served
            for t in layer.tensors
        }
        # Quantize on the whole skeleton so per-path overrides in the config apply as in mlx-lm.
        quantize_like_mlx_lm(
            skeleton, self.manifest.config, specs, only_under={layer.module for layer in served}
        )
        for layer in served:
            module = find_module(skeleton, layer.module)
            module.update(tree_unflatten(list(store.weights(layer.layer).items())))
            module.eval()
            self._modules[layer.layer] = module
            found = SwitchGLUKernel.for_module(module) if use_kernel else None
            if found is not None:
                self._kernels[layer.layer] = found
            self._widths[layer.layer] = expert_width(module) or self.manifest.hidden_size
            local = np.full(layer.num_experts, -1, dtype=np.int32)
            experts = store.owned[layer.layer]
            local[experts] = np.arange(len(experts), dtype=np.int32)
            self._local_index[layer.layer] = local
        # Layers held whole and in RAM: an expert id is its own row, and nothing is planned or
        # read per call (the usual placement of a same-host worker; a one-token call's checks
        # and lookups then cost a few numpy calls instead of a dozen).
        self._resident = isinstance(store, ResidentExpertStore)
        self._whole = {layer.layer: len(store.owned[layer.layer]) == layer.num_experts for layer in served}

    @property
    def kernel_name(self) -> str:
        """What computes the served layers: "cpu" (all by the C kernel), "mlx", or "mixed"."""
        if not self._kernels:
            return "mlx"
        return "cpu" if len(self._kernels) == len(self._modules) else "mixed"

    def run(self, call: expert_pb2.ExpertCall) -> expert_pb2.ExpertResult:
        """Compute one call. Raises CallRejected for anything malformed."""
        started_ns = time.monotonic_ns()
        t0 = time.perf_counter()
        module = self._modules.get(call.layer)
        if module is None:
            raise CallRejected("layer", f"layer {call.layer} is not served by this worker")
        local_index = self._local_index[call.layer]
        try:
            ids = tensor_codec.decode_numpy(call.expert_ids, "expert_ids", self.max_call_bytes, ndim=2)
            if call.hidden.dtype not in HIDDEN_WIRE_DTYPES:
                raise CallRejected(
                    "hidden.dtype",
                    f"{tensor_codec.wire_dtype_label(call.hidden.dtype)} given; hidden states are FLOAT32, FLOAT16 or BFLOAT16",
                )
            hidden = tensor_codec.decode_numpy(call.hidden, "hidden", self.max_call_bytes, ndim=2)
        except TensorDecodeError as error:
            raise CallRejected(error.field, str(error).split(": ", 1)[1]) from None
        if call.expert_ids.dtype != tensor_pb2.DType.INT32:
            raise CallRejected("expert_ids.dtype", "must be INT32")
        tokens, hidden_size = hidden.shape
        if hidden_size != self._widths[call.layer]:
            raise CallRejected(
                "hidden.shape",
                f"hidden size {hidden_size}, layer {call.layer}'s experts take {self._widths[call.layer]}",
            )
        if ids.shape[0] != tokens:
            raise CallRejected("expert_ids.shape", f"{ids.shape[0]} rows for {tokens} tokens in hidden")
        low, high = (int(ids.min()), int(ids.max())) if ids.size else (0, 0)
        if high >= len(local_index) or low < -1:
            raise CallRejected("expert_ids", f"expert ids must lie in [-1, {len(local_index)})")
        everything_asked = low >= 0
        asked = None if everything_asked else ids >= 0  # None: every pair
        pair_count = ids.size if everything_asked else int(asked.sum())
        reply_bytes = pair_count * hidden_size * hidden.itemsize
        if reply_bytes > self.max_call_bytes:  # one output row per pair: k times the input
            raise CallRejected(
                "expert_ids",
                f"the reply would take {reply_bytes} bytes, more than the cap of {self.max_call_bytes}",
            )
        if not self._whole[call.layer]:
            self._check_owned(call.layer, ids, asked)
        t1 = time.perf_counter()
        reply = self.compute_rows(call.layer, hidden, ids, asked, pair_count)
        t2 = time.perf_counter()
        result = expert_pb2.ExpertResult(call_id=call.call_id)
        tensor_codec.encode_numpy(reply, call.hidden.dtype, result.output)
        t3 = time.perf_counter()
        stats = result.stats
        stats.decode_us, stats.compute_us, stats.encode_us = (
            int((t1 - t0) * 1e6),
            int((t2 - t1) * 1e6),
            int((t3 - t2) * 1e6),
        )
        stats.pairs = pair_count
        stats.started_ns, stats.finished_ns = started_ns, time.monotonic_ns()
        return result

    def _check_owned(self, layer: int, ids: np.ndarray, asked: np.ndarray | None) -> None:
        """Raise CallRejected naming the asked experts (ids in range) this worker does not hold."""
        local = self._local_index[layer][ids]  # -1 (not asked) reads the last row: masked out below
        owned = local >= 0
        unowned = ~owned if asked is None else asked & ~owned
        if unowned.any():
            missing = sorted(set(ids[unowned].tolist()))
            raise CallRejected(
                "expert_ids", f"experts {missing[:8]} of layer {layer} are not served by this worker"
            )

    def module(self, layer: int) -> nn.Module:
        """The layer's mlx-lm expert module: rows are this worker's experts in local order."""
        return self._modules[layer]

    def in_graph_rows(self, layer: int) -> bool:
        """Whether the layer can be computed inside another graph, on local rows, with no
        synchronisation: its experts resident in RAM and computed by MLX, not the CPU kernel."""
        return layer in self._modules and layer not in self._kernels and self._resident

    def in_graph_module(self, layer: int) -> nn.Module | None:
        """The layer's module where it can stand in another model's graph as is: computed in
        the graph (`in_graph_rows`) with every expert of the layer, in global order."""
        return self._modules[layer] if self._whole.get(layer) and self.in_graph_rows(layer) else None

    def compute_rows(
        self,
        layer: int,
        hidden: np.ndarray,
        ids: np.ndarray,
        asked: np.ndarray | None = None,
        pair_count: int | None = None,
    ) -> np.ndarray:
        """The asked pairs' output rows [pairs, H] in call order and the wire form of `hidden`'s
        dtype, for validated host arrays: hidden [T, H] (wire form), ids [T, k] of owned experts
        (-1 = not asked; `asked` marks the others, None = every pair)."""
        module = self._modules[layer]
        hidden_size = hidden.shape[1]
        if asked is None or pair_count == ids.size:
            asked, pair_count = None, ids.size
        everything_asked = asked is None
        tokens = hidden.shape[0]
        # The store says where each expert's weights sit (reading the missing ones from disk); a
        # call whose experts do not fit its memory together is computed group by group. Every
        # expert in RAM in global order needs no plan: the ids are the rows.
        direct = self._resident and self._whole[layer]
        groups = [] if direct else self.store.plan(layer, np.unique(ids[ids >= 0]).tolist())
        kernel = self._kernels.get(layer)
        if kernel is not None:
            return self._run_kernel(kernel, layer, hidden, ids, asked, pair_count, groups)
        if len(groups) > 1:
            return self._run_in_groups(layer, module, tensor_codec.to_mlx(hidden), ids, groups)
        slot = ids if direct else self.store.load(layer, groups[0] if groups else [])[ids]
        per_token = None if everything_asked else asked.sum(axis=1)
        if everything_asked:
            hidden, slot_ids = tensor_codec.to_mlx_with_ids(hidden, slot)
            out = module(hidden, slot_ids).reshape(-1, hidden_size)
        elif per_token[0] > 0 and (per_token == per_token[0]).all():
            # Every token asks as many pairs (a decode step split over workers): keep them as
            # each token's experts, [T, c], instead of one row per pair — one gather of
            # hidden rows less, same math, rows in the same (row-major) order.
            compact = slot[asked].reshape(tokens, int(per_token[0]))
            hidden, slot_ids = tensor_codec.to_mlx_with_ids(hidden, compact)
            out = module(hidden, slot_ids).reshape(-1, hidden_size)
        else:
            rows, cols = np.nonzero(asked)
            hidden, pair_ids = tensor_codec.to_mlx_with_ids(hidden[rows], slot[rows, cols][:, None])
            out = module(hidden, pair_ids).reshape(-1, hidden_size)
        # replies come in the dtype the call came in: core's model computes in it (mlx-lm
        # promotes bf16 states through float32 norms to float32, for instance)
        # the one synchronisation of the call on the worker side
        return tensor_codec.numpy_view(out.astype(hidden.dtype))

    def _run_kernel(self, kernel, layer, hidden, ids, asked, pairs, groups) -> np.ndarray:
        """The asked pairs' rows, in call order, from the CPU kernel, one planned group at a time
        (`asked` None: every pair)."""
        threads = min(self.threads, max(1, pairs * 3 * kernel.hidden * kernel.inter // self.macs_per_thread))
        if len(groups) <= 1:
            slot = self.store.load(layer, groups[0] if groups else [])
            if asked is None:
                token = np.repeat(np.arange(ids.shape[0], dtype=np.int32), ids.shape[1])
                return kernel(hidden, token, slot[ids].ravel(), threads)
            rows, cols = np.nonzero(asked)
            return kernel(hidden, rows, slot[ids[rows, cols]], threads)
        asked = ids >= 0
        pair_index = (np.cumsum(asked.ravel()) - 1).reshape(asked.shape)
        reply = np.empty((pairs, hidden.shape[1]), dtype=hidden.dtype)
        for group in groups:
            slot_of = self.store.load(layer, group)
            rows, cols = np.nonzero(asked & np.isin(ids, group))
            reply[pair_index[rows, cols]] = kernel(hidden, rows, slot_of[ids[rows, cols]], threads)
        return reply

    def _run_in_groups(self, layer, module, hidden, ids, groups) -> np.ndarray:
        """Rows of the asked pairs (ids >= 0), computed one planned group of experts at a time.

        Each group is evaluated before the next `load` may reuse its memory; every pair
        goes through the module on its own row, as in the one-group path for partial calls.
        """
        asked = ids >= 0
        pair_index = (np.cumsum(asked.ravel()) - 1).reshape(asked.shape)
        reply = None
        for group in groups:
            slot_of = self.store.load(layer, group)
            rows, cols = np.nonzero(asked & np.isin(ids, group))
            pairs = module(hidden[mx.array(rows)], mx.array(slot_of[ids[rows, cols]])[:, None])
            wire = tensor_codec.wire_form(pairs.reshape(-1, hidden.shape[1]).astype(hidden.dtype))
            mx.eval(wire)
            part = np.asarray(wire)
            if reply is None:
                reply = np.empty((int(asked.sum()), hidden.shape[1]), dtype=part.dtype)
            reply[pair_index[rows, cols]] = part
        return reply
