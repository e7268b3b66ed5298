"""`attention_path`: run a test once on the pure-MLX twin and once on this device's fused
kernels (on a CPU: metal/turboquant_cpu.c), so that the twin stays tested everywhere even
where kernels serve by default."""

from __future__ import annotations

import pytest

from services.core.kv import kernel_select


@pytest.fixture(params=["twin", "kernels"])
def attention_path(request, monkeypatch):
    if request.param == "twin":
        monkeypatch.setattr(kernel_select, "kernel_backend", lambda: None)
    elif kernel_select.kernel_backend() is None:
        pytest.skip("no fused-kernel backend on this device (no GPU kernels, CPU extension not built)")
    return request.param
