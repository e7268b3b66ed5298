"""CUDA kernels (metal/turboquant.cu) against the pure-MLX twin. The comparison needs MLX's
CUDA backend and is skipped elsewhere; where nvcc exists (without a GPU) the kernels are
at least compiled the way mx.fast.cuda_kernel wraps them, so a typo cannot wait for a GPU."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess

import mlx.core as mx
import pytest

from metal import backend, cuda_kernels, kernels
from services.core.kv import (
    PAPER_SETTINGS,
    KVCacheSettings,
    TurboQuantKVCache,
    kernel_select,
    turboquant_attention,
)
from services.core.kv.kernel_check import backend_matches_twin, kernels_pass

needs_cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="CUDA kernels need MLX's CUDA backend")


def test_cuda_and_metal_sources_have_the_same_sections():
    cuda, metal = cuda_kernels.sections(), kernels._sections()
    assert set(cuda) == set(metal) == {"header", *backend.KERNELS}
    for name, (_inputs, outputs, _) in backend.KERNELS.items():
        for source in (cuda[name], metal[name]):
            assert all(output in source for output in outputs), name


def test_kernels_are_never_used_without_cuda():
    assert "metal.cuda_kernels" in kernel_select.BACKENDS
    if not mx.cuda.is_available():
        assert not kernels_pass(cuda_kernels)
    else:
        assert kernels_pass(cuda_kernels) == backend_matches_twin(cuda_kernels)


# ---- compiled like mx.fast.cuda_kernel does it (nvcc, no GPU needed) ----------------------

_MLX_UTILS = """#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cuda/std/limits>
#include <cstdint>
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, 10>;
using Strides = cuda::std::array<int64_t, 10>;
}
"""
_TYPES = {"f": "float", "h": "__half", "b": "uint8_t", "i": "int32_t"}
# input types (one letter per input), output types, template of one realistic call
_CALLS = {
    "pack": ("fffff", "hbhb", {"P": 128, "D": 80, "BITS": 3, "QJL": 1, "CODE_BYTES": 48}),
    "scores": ("ffbhhbff", "f", {"P": 128, "L": 9, "ROWS": 8, "BITS": 3, "QJL": 1, "CODE_BYTES": 48}),
    "values": ("fbhf", "f", {"P": 64, "L": 3, "ROWS": 8, "CHUNK": 256, "BITS": 4, "CODE_BYTES": 32}),
    "decode_partial": (
        "hfihhhhhbhbhbffff",
        "fff",
        {
            "P": 128,
            "D": 128,
            "R": 8,
            "L": 1,
            "TB": 256,
            "KBITS": 3,
            "VBITS": 3,
            "QJL": 1,
            "QT": "__half",
            "KT": "__half",
        },
    ),
    "decode_combine": ("fffif", "h", {"P": 128, "D": 128, "R": 8, "TB": 256, "OT": "__half"}),
    "decode_run": (
        "hbhbhbfff",
        "hhh",
        {"P": 128, "KBITS": 3, "VBITS": 3, "QJL": 1, "KCODE_BYTES": 48, "VCODE_BYTES": 48, "OT": "__half"},
    ),
}


def mlx_style_source(sections: dict[str, str]) -> str:
    """All kernels in one translation unit, each wrapped as MLX's build_kernel wraps it."""
    out = [
        '#include "mlx/backend/cuda/device/utils.cuh"',
        "#include <cooperative_groups.h>",
        sections["header"],
        "namespace mlx::core::cu {",
    ]
    for name, (inputs, outputs, _) in backend.KERNELS.items():
        in_types, out_types, template = _CALLS[name]
        body, params = sections[name], []
        for input_name, kind in zip(inputs, in_types, strict=True):
            params.append(f"const {_TYPES[kind]}* {input_name}")
            for suffix, kind_name in (("_shape", "Shape"), ("_strides", "Strides")):
                if input_name + suffix in body:
                    params.append(f"const __grid_constant__ {kind_name} {input_name}{suffix}")
        params += [f"{_TYPES[kind]}* {n}" for n, kind in zip(outputs, out_types, strict=True)]
        constants = [
            f"using {k} = {v};" if isinstance(v, str) else f"constexpr int {k} = {v};"
            for k, v in template.items()
        ]
        out.append(f"__global__ void turboquant_{name}({', '.join(params)}) {{")
        out += constants + [body, "}"]
    out.append("}")
    return "\n".join(out)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit)")
def test_every_kernel_compiles_as_mlx_wraps_it(tmp_path):
    header = tmp_path / "mlx" / "backend" / "cuda" / "device" / "utils.cuh"
    header.parent.mkdir(parents=True)
    header.write_text(_MLX_UTILS)
    source = tmp_path / "turboquant_all.cu"
    source.write_text(mlx_style_source(cuda_kernels.sections()))
    result = subprocess.run(
        [
            "nvcc",
            "-arch=sm_90",
            "-std=c++17",
            f"-I{tmp_path}",
            "-c",
            str(source),
            "-o",
            str(tmp_path / "k.o"),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]


# ---- on a CUDA device ---------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("seed", [0, 1])
def test_kernels_match_the_twin(seed):
    failures = []
    assert backend_matches_twin(cuda_kernels, seed, failures), failures


@needs_cuda
def test_cuda_devices_serve_turboquant_with_the_cuda_kernels():
    assert kernel_select.kernel_backend() is cuda_kernels


@needs_cuda
@pytest.mark.parametrize("bits", [KVCacheSettings(), PAPER_SETTINGS], ids=lambda s: s.describe())
def test_live_decode_through_blocks_a_trim_and_a_batch_equals_the_twin(monkeypatch, bits):
    """A cache filled by its own update path (the CUDA pack kernel), blocks aging out of the
    window on the way, a trim back into the compressed run, two batch rows: each step of the
    served (fused) path equals the twin's, for the default and the paper's K3+QJL/V3."""
    settings = dataclasses.replace(bits, sink_tokens=4, recent_window=16, block_size=8)
    mx.random.seed(5)
    cache = TurboQuantKVCache(settings, layer=4)
    keys, values = mx.random.normal((2, 2, 400, 64)) * 2, mx.random.normal((2, 2, 400, 64))
    cache.update_and_fetch(keys[:, :, :300], values[:, :, :300])

    def check():
        queries = mx.random.normal((2, 6, 1, 64))
        served = turboquant_attention(queries, cache, 0.125)
        with monkeypatch.context() as patch:
            patch.setattr(kernel_select, "kernel_backend", lambda: None)
            twin = turboquant_attention(queries, cache, 0.125)
        assert mx.allclose(served, twin, atol=1e-3).item()

    for i in range(300, 330):
        cache.update_and_fetch(keys[:, :, i : i + 1], values[:, :, i : i + 1])
        check()
    cache.trim(40)
    check()


@needs_cuda
def test_more_queries_than_the_fused_kernel_takes_fall_back_to_composed_kernels():
    settings = KVCacheSettings(sink_tokens=4, recent_window=16, block_size=8)
    cache = TurboQuantKVCache(settings, layer=0)
    keys = mx.random.normal((1, 2, 200, 64))
    cache.update_and_fetch(keys, keys)
    assert cuda_kernels.decode_attention(mx.random.normal((1, 4, 9, 64)), cache, 0.125, 191) is None
