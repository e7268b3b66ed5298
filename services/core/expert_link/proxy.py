"""The stand-in for mlx-lm's SwitchGLU/SwitchMLP in core: same call, computed remotely.

mlx-lm's MoE blocks call `self.switch_mlp(x, indices)` with x [..., H] and the
router's top-k indices [..., k] and expect [..., k, H]; the router, score
normalisation, weighting and shared experts around that call stay in core,
unchanged. This module has no parameters, so core never reads routed-expert weights.
"""

from __future__ import annotations

import time

import mlx.core as mx
from mlx import nn

from services.common import tensor_codec
from services.core.expert_link.dispatcher import ExpertDispatcher
from services.core.expert_link.in_flight import settle_pending
from services.core.expert_link.step_merge import expert_call


class RemoteExperts(nn.Module):
    def __init__(self, layer: int, dispatcher: ExpertDispatcher):
        super().__init__()
        # Plain attributes prefixed with "_" are not parameters in mlx.nn.Module.
        self._layer = layer
        self._dispatcher = dispatcher

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        hidden_size, k = x.shape[-1], indices.shape[-1]
        # Evaluate the hidden states in their wire form (bf16 as uint16) so the dispatcher reads
        # bytes without another sync. They go in their own dtype, which need not be the weights'
        # (bf16 states meet float32 norms and leave them float32), as mlx-lm's experts see them.
        flat_x = tensor_codec.wire_form(x.reshape(-1, hidden_size))
        flat_ids = indices.reshape(-1, k).astype(mx.int32)  # routers give uint32; the wire wants int32
        # The previous layer's answer may still be on its way (ExpertDispatcher.call): it
        # lands in the graph before anything is evaluated.
        settle_pending()
        started = time.perf_counter()
        mx.eval(flat_x, flat_ids)  # the one synchronisation of this layer on the core side
        self._dispatcher.timings.record_part("core_sync", (time.perf_counter() - started) * 1e6)
        # Inside an engine step this joins the layer's one call for all the step's forwards.
        out = expert_call(self._dispatcher, self._layer, flat_x, flat_ids)
        return out.reshape(*indices.shape, hidden_size)
