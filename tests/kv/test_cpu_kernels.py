"""The CPU kernels (metal/turboquant_cpu.c) against the pure-MLX twin. They run wherever
MLX computes on the CPU and setup.py could compile the extension, which is every machine
with a C compiler, CI included."""

from __future__ import annotations

import dataclasses
import shutil

import mlx.core as mx
import pytest

from metal import cpu_kernels
from services.core.kv import (
    PAPER_SETTINGS,
    KVCacheSettings,
    TurboQuantKVCache,
    kernel_check,
    kernel_select,
    turboquant_attention,
)
from services.core.kv.kernel_check import backend_matches_twin, kernels_pass

on_cpu = mx.default_device() == mx.cpu
needs_kernels = pytest.mark.skipif(
    not (on_cpu and cpu_kernels._library() is not None), reason="CPU extension not built or not on a CPU"
)


@pytest.mark.skipif(not on_cpu or shutil.which("cc") is None, reason="needs a CPU device and a C compiler")
def test_install_builds_the_extension_and_cpus_use_it():
    assert cpu_kernels._library() is not None, "setup.py did not build metal._turboquant_cpu"
    assert kernels_pass(cpu_kernels)
    assert kernel_select.kernel_backend() is cpu_kernels


@needs_kernels
@pytest.mark.parametrize("seed", [0, 1])
def test_kernels_match_the_twin(seed):
    assert backend_matches_twin(cpu_kernels, seed)


@needs_kernels
def test_head_dims_the_kernels_do_not_take_fall_back_to_the_twin(monkeypatch):
    settings = KVCacheSettings(sink_tokens=2, recent_window=2, block_size=4)
    cache = TurboQuantKVCache(settings, layer=0)  # head dim 1100, padded to 2048: past the kernels' 1024
    cache.update_and_fetch(mx.random.normal((1, 2, 12, 1100)), mx.random.normal((1, 2, 12, 1100)))
    queries = mx.random.normal((1, 4, 1, 1100))
    assert cpu_kernels.decode_attention(queries, cache, 0.03, cache.offset - 1) is None
    served = turboquant_attention(queries, cache, 0.03)
    monkeypatch.setattr(kernel_select, "kernel_backend", lambda: None)
    assert mx.array_equal(served, turboquant_attention(queries, cache, 0.03)).item()


@needs_kernels
@pytest.mark.parametrize("bits", [KVCacheSettings(), PAPER_SETTINGS], ids=lambda s: s.describe())
def test_kernel_attention_equals_the_twin_through_a_long_decode(monkeypatch, bits):
    """The default (K4/V3) and the paper's K3+QJL/V3, blocks aging out of the window on the
    way, a trim into the compressed run, and a batch of two rows: the served path equals the twin."""
    settings = dataclasses.replace(bits, sink_tokens=4, recent_window=16, block_size=8)
    mx.random.seed(5)
    cache = TurboQuantKVCache(settings, layer=4)
    keys, values = mx.random.normal((2, 2, 120, 64)) * 2, mx.random.normal((2, 2, 120, 64))
    cache.update_and_fetch(keys[:, :, :90], values[:, :, :90])

    def both(queries):
        kernels = turboquant_attention(queries, cache, 0.125)
        with monkeypatch.context() as patch:
            patch.setattr(kernel_select, "kernel_backend", lambda: None)
            twin = turboquant_attention(queries, cache, 0.125)
        return kernels, twin

    for t in range(90, 120):
        cache.update_and_fetch(keys[:, :, t : t + 1], values[:, :, t : t + 1])
        kernels, twin = both(mx.random.normal((2, 6, 1, 64)))
        assert mx.allclose(kernels, twin, atol=1e-5).item()
    cache.trim(30)
    kernels, twin = both(mx.random.normal((2, 6, 4, 64)))
    assert mx.allclose(kernels, twin, atol=1e-5).item()


@needs_kernels
@pytest.mark.parametrize(("dim", "n_queries"), [(36, 1), (36, 5), (128, 2)])
def test_fused_step_equals_the_twin_for_head_dims_with_a_tail(dim, n_queries):
    """Exact runs are scored over D (36: a tail past the 8-lane loop); compressed ones over
    the padded P; several queries need the causal mask inside the compressed run."""
    from services.core.kv.decode_attention import decode_attention as twin_step

    settings = KVCacheSettings(sink_tokens=4, recent_window=4, block_size=4)
    mx.random.seed(dim + n_queries)
    cache = TurboQuantKVCache(settings, layer=1)
    keys, values = mx.random.normal((1, 2, 50, dim)) * 2, mx.random.normal((1, 2, 50, dim))
    cache.update_and_fetch(keys, values)
    queries = mx.random.normal((1, 4, n_queries, dim))
    got = cpu_kernels.decode_attention(queries, cache, 0.3, cache.offset - n_queries)
    assert mx.allclose(got, twin_step(queries, cache, 0.3), rtol=1e-4, atol=1e-5).item()


@needs_kernels
def test_the_backend_is_checked_once_and_its_check_never_recurses(monkeypatch):
    """The self-check builds TurboQuant caches, whose encoder asks for the backend: that
    nested question must get the twin, not start another self-check. (A pass kept from an
    earlier process would skip the check altogether: metal/selfcheck.py.)"""
    monkeypatch.setenv("MOE_MESH_SELFCHECK_CACHE", "0")
    calls = []
    check = kernel_check.backend_matches_twin
    monkeypatch.setattr(kernel_check, "backend_matches_twin", lambda *a: calls.append(1) or check(*a))
    kernel_select._select_backend.cache_clear()
    try:
        assert kernel_select.kernel_backend() is cpu_kernels
        assert kernel_select.kernel_backend() is cpu_kernels
        assert calls == [1]
    finally:
        kernel_select._select_backend.cache_clear()
