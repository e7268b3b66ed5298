"""Routed experts on CPUs: mlx-lm's quantized SwitchGLU computed by metal/experts_cpu.c.

`SwitchGLUKernel.for_module(module)` takes a layer's expert module as mlx-lm built it and
returns a kernel that computes the same numbers on the module's own weight memory (NumPy
views, no copy: a streaming store that writes new experts into that memory is seen at once),
or None where the module is anything else — another activation, biases, float or non-affine
weights, 3/5/6-bit packing — and mlx-lm's module computes. The C extension is optional (setup.py
skips it without a compiler); `available()` says whether it is here.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from functools import cache

import mlx.core as mx
import numpy as np

from metal import load_extension

KERNELS = ("auto", "mlx")  # what an expert worker may compute its layers with (--expert-kernel)

# wire form of a dtype (bf16 travels and is held as its uint16 bits) -> the kernel's code
_CODES = {np.dtype("<f4"): 0, np.dtype("<f2"): 1, np.dtype("<u2"): 2}
_MLX_CODES = {mx.float32: 0, mx.float16: 1, mx.bfloat16: 2}
_FLOAT32 = _MLX_CODES[mx.float32]
_BITS = (2, 4, 8)
_P = ctypes.c_void_p
_I = ctypes.c_int


@cache
def _library():
    lib = load_extension("_experts_cpu")
    if lib is None:
        return None
    # T, H, I, dtype, compute dtype, x, P, tokens, slots, E
    lib.moe_switch_glu.argtypes = [_I, _I, _I, _I, _I, _P, _I, _P, _P, _I]
    lib.moe_switch_glu.argtypes += [
        _P,
        _P,
        _P,
        _I,
        _I,
    ] * 3  # gate, up, down: weight, scales, biases, bits, group
    lib.moe_switch_glu.argtypes += [_I, _P, _I]  # scale dtype, out, threads
    lib.moe_switch_glu.restype = ctypes.c_int
    # T, in, out, dtype, x, weight, scales, biases, bits, group, scale dtype, out, threads
    lib.moe_quantized_linear.argtypes = [_I, _I, _I, _I, _P, _P, _P, _P, _I, _I, _I, _P, _I]
    lib.moe_quantized_linear.restype = ctypes.c_int
    lib.moe_has_avx2.restype = ctypes.c_int
    lib.moe_force_scalar.argtypes = [_I]
    return lib


def available() -> bool:
    return _library() is not None


def simd() -> str:
    lib = _library()
    return "none" if lib is None else ("avx2" if lib.moe_has_avx2() else "scalar")


def force_portable(on: bool) -> None:
    """Compute with the portable C loop even where AVX2 is present (tests compare the two)."""
    _library().moe_force_scalar(int(on))


def _host_view(array: mx.array) -> np.ndarray | None:
    """A NumPy view of the array's own memory (bf16 as uint16), or None where MLX would copy."""
    mx.eval(array)
    if array.dtype == mx.bfloat16:
        first, second = np.asarray(array.view(mx.uint16)), np.asarray(array.view(mx.uint16))
        # two views at one address are views of the array's buffer, not copies of it
        return first if first.ctypes.data == second.ctypes.data else None
    view = np.asarray(array)
    return view if view.flags.c_contiguous else None


@dataclass(frozen=True)
class _Projection:
    weight: np.ndarray  # uint32 [E, O, I * bits / 32]
    scales: np.ndarray  # [E, O, I / group_size]
    biases: np.ndarray
    bits: int
    group_size: int
    scale_code: int

    def arguments(self) -> list:
        return [
            self.weight.ctypes.data,
            self.scales.ctypes.data,
            self.biases.ctypes.data,
            self.bits,
            self.group_size,
        ]

    def fits(self, experts: int, out_dim: int, in_dim: int) -> bool:
        """Whether the arrays are what MLX's layout says for [experts, out_dim, in_dim] weights:
        the C kernel trusts these shapes (mlx-lm's module would refuse anything else)."""
        groups, rest = divmod(in_dim, self.group_size)
        return (
            rest == 0
            and self.weight.shape == (experts, out_dim, in_dim * self.bits // 32)
            and self.scales.shape == (experts, out_dim, groups)
            and self.biases.shape == self.scales.shape
        )


def _projection(linear) -> _Projection | None:
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    if type(linear) is not QuantizedSwitchLinear or "bias" in linear:
        return None
    if (
        linear.mode != "affine"
        or linear.bits not in _BITS
        or getattr(linear, "global_scale", None) is not None
    ):
        return None
    biases = linear.get("biases")
    if biases is None or linear.weight.dtype != mx.uint32 or linear.scales.dtype not in _MLX_CODES:
        return None
    if biases.dtype != linear.scales.dtype:
        return None
    views = [_host_view(a) for a in (linear.weight, linear.scales, biases)]
    if any(v is None for v in views):
        return None
    return _Projection(*views, linear.bits, linear.group_size, _MLX_CODES[linear.scales.dtype])


class SwitchGLUKernel:
    """One layer's SwitchGLU (silu(gate(x)) * up(x), then down) for (token, expert row) pairs."""

    def __init__(self, gate: _Projection, up: _Projection, down: _Projection, hidden: int, inter: int):
        self._parts = (gate, up, down)  # their views keep the memory the pointers below point into
        self._scale_code = gate.scale_code
        # the weights' pointers and packing, as the C call takes them (fixed: built once, not per call)
        self._weight_args = (*gate.arguments(), *up.arguments(), *down.arguments(), gate.scale_code)
        self.hidden, self.inter = hidden, inter
        self.experts = gate.weight.shape[0]

    @classmethod
    def for_module(cls, module) -> SwitchGLUKernel | None:
        if _library() is None:
            return None
        from mlx_lm.models.switch_layers import SwiGLU, SwitchGLU

        if type(module) is not SwitchGLU or type(module.activation) is not SwiGLU:
            return None
        parts = [_projection(p) for p in (module.gate_proj, module.up_proj, module.down_proj)]
        if any(p is None for p in parts):
            return None
        gate, up, down = parts
        experts, inter = gate.weight.shape[:2]
        hidden = down.weight.shape[1]
        if (
            len({p.scale_code for p in parts}) != 1
            or gate.group_size != up.group_size
            or not gate.fits(experts, inter, hidden)
            or not up.fits(experts, inter, hidden)
            or not down.fits(experts, hidden, inter)
        ):
            return None
        return cls(gate, up, down, hidden, inter)

    def __call__(
        self, hidden: np.ndarray, token: np.ndarray, row: np.ndarray, threads: int = 1
    ) -> np.ndarray:
        """hidden [T, H] in its wire form; token, row [P] int32 (row: the expert's index in the
        weights). Returns [P, H] in hidden's wire form: pair i is expert row[i] on token[i]."""
        code = _CODES.get(hidden.dtype)
        if code is None or hidden.ndim != 2 or hidden.shape[1] != self.hidden:
            raise ValueError(
                f"hidden must be [T, {self.hidden}] float32/float16/bf16 bits, got {hidden.dtype} {hidden.shape}"
            )
        hidden = np.ascontiguousarray(hidden)
        token = np.ascontiguousarray(token, dtype=np.int32)
        row = np.ascontiguousarray(row, dtype=np.int32)
        if token.ndim != 1 or token.shape != row.shape:
            raise ValueError(f"token and row must be equal-length vectors, got {token.shape} and {row.shape}")
        # MLX computes in the promotion of the hidden states' and the scales' types: among float32,
        # float16 and bfloat16 that is the type itself where they agree, float32 otherwise
        compute = code if code == self._scale_code else _FLOAT32
        out = np.empty((len(token), self.hidden), dtype=hidden.dtype)
        status = _library().moe_switch_glu(
            hidden.shape[0], self.hidden, self.inter, code, compute, hidden.ctypes.data, len(token),
            token.ctypes.data, row.ctypes.data, self.experts,
            *self._weight_args, out.ctypes.data, max(1, int(threads)),
        )  # fmt: skip
        if status == -2:
            raise MemoryError("expert kernel: out of memory for its scratch buffers")
        if status == -3:
            raise ValueError("expert kernel: a pair's token or expert row is out of range")
        if status != 0:
            raise ValueError(f"expert kernel: layout refused (status {status})")
        return out


def default_threads() -> int:
    """CPUs this process may use: its affinity set, lowered to a cgroup v2 CPU quota if one is set
    (a container given 2 CPUs of a 64-core host sees all 64 in its affinity)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return cpus
