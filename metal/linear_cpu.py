"""Core's quantized projections on CPUs: mlx-lm's QuantizedLinear computed by metal/experts_cpu.c.

Why: MLX's CPU quantized matmul is a scalar loop (and its float32 matmul on Linux calls the reference
BLAS), so on a Linux CPU the core's attention projections and lm_head ran at a few GFLOPS and took
most of a prefill's time (`python bench/split_ab.py --compare dense`). The experts' kernel already
dots MLX's packed rows with SIMD; a dense projection is one expert's matrix.

`use_cpu_kernels(model)` swaps the class of each eligible `nn.QuantizedLinear` (and the tied
`nn.QuantizedEmbedding` of `as_linear`) for a subclass whose product runs in C on the module's own
weight memory: the parameters and their paths stay as loaded. A product is eager (the kernel needs
x's values), so it first runs the `settle` hook `use_cpu_kernels` was given (core's: finish a
layer call in flight, services/core/expert_link/in_flight.py), then evaluates x. That is free where the output
is always used (projections feed the KV cache and the next layer); an output head is not: mlx-lm evaluates only the last position's logits of a prompt
and MLX prunes the rest, so heads take the kernel only for up to HEAD_POSITIONS positions per
sequence (a decode step, or one that verifies a few drafted tokens, whose logits are all used; at
that size computing every position in C costs less than MLX's product for the one a prompt needs)
and leave longer inputs to MLX. Anything the kernel does not take (3/5/6-bit, mxfp4, no biases,
an input inside mx.compile or vmap) stays on MLX's own op.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from metal.experts_cpu import _BITS, _MLX_CODES, _host_view, _library

HEAD_POSITIONS = 8  # the most positions per sequence an output head computes in C
PARALLEL_MACS = 1 << 21  # a product smaller than this runs on the calling thread (threads cost ~20 µs)
_NUMPY_OF = {mx.float32: np.float32, mx.float16: np.float16, mx.bfloat16: np.uint16}


@dataclass(frozen=True)
class _Rows:
    """A [out, in] quantized matrix as the C call takes it (views keep the memory alive)."""

    weight: np.ndarray
    scales: np.ndarray
    biases: np.ndarray
    out_dim: int
    in_dim: int
    bits: int
    group_size: int
    dtype: mx.Dtype  # of the scales: MLX computes in the promotion of x's and this type
    heads_at_few_positions_only: bool
    settle: Callable[[], None]  # run before x is evaluated


def _nothing_to_settle() -> None:
    pass


def _rows(module: nn.Module, head: bool, settle: Callable[[], None] = _nothing_to_settle) -> _Rows | None:
    if getattr(module, "mode", "affine") != "affine" or module.bits not in _BITS:
        return None
    if getattr(module, "global_scale", None) is not None:
        return None
    biases = module.get("biases")
    weight, scales = module["weight"], module["scales"]
    if (
        biases is None
        or weight.dtype != mx.uint32
        or scales.dtype not in _MLX_CODES
        or biases.dtype != scales.dtype
    ):
        return None
    if weight.ndim != 2 or scales.shape != biases.shape or scales.ndim != 2:
        return None
    out_dim, in_dim = weight.shape[0], weight.shape[1] * 32 // module.bits
    if scales.shape != (out_dim, in_dim // module.group_size) or in_dim % module.group_size:
        return None
    views = [_host_view(a) for a in (weight, scales, biases)]
    if any(v is None for v in views):
        return None
    return _Rows(*views, out_dim, in_dim, module.bits, module.group_size, scales.dtype, head, settle)


def _threads(macs: int) -> int:
    if macs < PARALLEL_MACS:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(cores, 8)


def product(rows: _Rows, x: mx.array) -> mx.array | None:
    """x @ W.T for x [..., in], as mx.quantized_matmul(transpose=True) gives it; None where MLX must."""
    if x.shape[-1] != rows.in_dim or x.dtype not in _NUMPY_OF:
        return None
    if rows.heads_at_few_positions_only and (x.ndim < 2 or x.shape[-2] > HEAD_POSITIONS):
        return None
    rows.settle()  # in core, x may hang on a layer call in flight
    dtype = x.dtype if x.dtype == rows.dtype else mx.float32  # MLX's promotion among these three
    x = x.astype(dtype)
    try:
        mx.eval(x)
    except (ValueError, RuntimeError):  # a tracer (inside mx.compile or vmap) has no values
        return None
    host = np.ascontiguousarray(np.asarray(x.view(mx.uint16) if dtype == mx.bfloat16 else x))
    tokens = host.size // rows.in_dim
    out = np.empty((tokens, rows.out_dim), dtype=_NUMPY_OF[dtype])
    status = _library().moe_quantized_linear(
        tokens, rows.in_dim, rows.out_dim, _MLX_CODES[dtype], host.ctypes.data, rows.weight.ctypes.data,
        rows.scales.ctypes.data, rows.biases.ctypes.data, rows.bits, rows.group_size, _MLX_CODES[rows.dtype],
        out.ctypes.data, _threads(tokens * rows.in_dim * rows.out_dim),
    )  # fmt: skip
    if status == -2:
        raise MemoryError("dense kernel: out of memory for its scratch buffers")
    if status != 0:
        raise ValueError(f"dense kernel: layout refused (status {status})")
    result = mx.array(out).reshape(*x.shape[:-1], rows.out_dim)
    return result.view(mx.bfloat16) if dtype == mx.bfloat16 else result


class KernelQuantizedLinear(nn.QuantizedLinear):
    """nn.QuantizedLinear whose product runs in C where it can (see the module docstring)."""

    def __call__(self, x: mx.array) -> mx.array:
        y = product(self._cpu_rows, x)
        if y is None:
            return super().__call__(x)
        return y + self["bias"] if "bias" in self else y


class KernelQuantizedEmbedding(nn.QuantizedEmbedding):
    """nn.QuantizedEmbedding whose `as_linear` (a tied output head) runs in C for one position."""

    def as_linear(self, x: mx.array) -> mx.array:
        y = product(self._cpu_rows, x)
        return super().as_linear(x) if y is None else y


def available() -> bool:
    lib = _library()
    return lib is not None and hasattr(lib, "moe_quantized_linear")


def use_cpu_kernels(
    model: nn.Module,
    settle: Callable[[], None] = _nothing_to_settle,
    heads_at_few_positions_only: bool = True,
) -> int:
    """Move the model's eligible quantized projections onto the C kernel; returns how many moved.
    Call after the weights are loaded (the kernel reads their memory in place). `settle()` runs
    before each product evaluates its input. `heads_at_few_positions_only=False`: output heads take
    the kernel for every position too (a caller that uses every position's logits: perplexity)."""
    if not available():
        return 0
    moved = 0
    for path, module in model.named_modules():
        kind = type(module)
        if kind is nn.QuantizedLinear:
            target, head = KernelQuantizedLinear, path == "lm_head" or path.endswith(".lm_head")
        elif kind is nn.QuantizedEmbedding:
            target, head = KernelQuantizedEmbedding, True  # its products are the tied head's
        else:
            continue
        rows = _rows(module, head and heads_at_few_positions_only, settle)
        if rows is None:
            continue
        module.__class__ = target
        object.__setattr__(module, "_cpu_rows", rows)  # not a parameter: plain attribute
        moved += 1
    return moved
