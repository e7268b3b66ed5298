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


def synced_inputs(x: mx.array, indices: mx.array) -> tuple[mx.array, mx.array, float]:
    """A MoE block's expert inputs, evaluated: hidden states [T, H] in their wire form (bf16 as
    uint16, so their bytes read without another sync) and the router's top-k ids [T, k] as int32
    (routers give uint32), after the answer of any layer call still in flight has landed in the
    graph. This is the layer's one synchronisation on core's side; also returns its seconds.
    The states keep their own dtype, which need not be the weights' (bf16 states meet float32
    norms and leave them float32), as mlx-lm's experts see them."""
    flat_x = tensor_codec.wire_form(x.reshape(-1, x.shape[-1]))
    flat_ids = indices.reshape(-1, indices.shape[-1]).astype(mx.int32)
    settle_pending()
    started = time.perf_counter()
    mx.eval(flat_x, flat_ids)
    return flat_x, flat_ids, time.perf_counter() - started


class RemoteExperts(nn.Module):
    def __init__(self, layer: int, dispatcher: ExpertDispatcher):
        super().__init__()
        # Plain attributes prefixed with "_" are not parameters in mlx.nn.Module.
        self._layer = layer
        self._dispatcher = dispatcher

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        flat_x, flat_ids, sync_s = synced_inputs(x, indices)
        self._dispatcher.timings.record_part("core_sync", sync_s * 1e6)
        # Inside an engine step this joins the layer's one call for all the step's forwards.
        out = expert_call(self._dispatcher, self._layer, flat_x, flat_ids)
        return out.reshape(*indices.shape, x.shape[-1])
