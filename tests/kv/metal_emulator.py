"""mx.fast.metal_kernel on a CPU, for testing the Metal sources where no Apple GPU exists.

`metal_kernel(...)` takes the arguments of mx.fast.metal_kernel and returns a kernel with its
call contract (inputs, template, grid, threadgroup, output shapes and dtypes). The body and
header are compiled as C++ against tests/kv/metal_emulator.h, which supplies the Metal
built-ins the bodies use (thread positions, threadgroup memory, barriers, SIMD-group sums,
half and bfloat16), and the grid runs one threadgroup at a time with one OS thread per GPU
thread. So metal/turboquant.metal's own arithmetic, indexing, bit layout, barriers and
reductions run, through metal/backend.py's own dispatch, against the pure-MLX twin.

What it cannot tell: whether Apple's Metal compiler accepts the source (C++ is close to, not
the same as, the Metal Shading Language) and how fast it runs. Inputs reach the kernel as MLX
would pass them: row-contiguous copies where `ensure_row_contiguous`, otherwise the array's
own view and strides. Outputs start as 0xFF bytes (NaN in floats) unless `init_value` is
given, so a kernel that leaves part of an output unwritten shows it, as uninitialised GPU
memory would.
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import shutil
import subprocess
import tempfile
import threading
from functools import cache
from pathlib import Path

import mlx.core as mx
import numpy as np

HERE = Path(__file__).resolve().parent
METAL_DIR = HERE.parents[1] / "metal"  # half_float.h, shared with the C kernels

# MLX dtype -> (the Metal type name a template or a pointer gets, the numpy type that holds it)
TYPES = {
    mx.float32: ("float", np.float32),
    mx.float16: ("float16_t", np.float16),
    mx.bfloat16: ("bfloat16_t", np.uint16),  # numpy has no bfloat16: its bits
    mx.uint8: ("uint8_t", np.uint8),
    mx.int8: ("int8_t", np.int8),
    mx.uint16: ("uint16_t", np.uint16),
    mx.int16: ("int16_t", np.int16),
    mx.uint32: ("uint32_t", np.uint32),
    mx.int32: ("int32_t", np.int32),
    mx.int64: ("int64_t", np.int64),
    mx.bool_: ("bool", np.bool_),
}
POSITIONS = (
    "thread_position_in_grid",
    "thread_position_in_threadgroup",
    "threadgroup_position_in_grid",
    "threadgroups_per_grid",
    "threads_per_threadgroup",
    "thread_index_in_threadgroup",
    "thread_index_in_simdgroup",
    "simdgroup_index_in_threadgroup",
)
_LAUNCH_LOCK = threading.Lock()  # threadgroup memory is static: one kernel runs at a time


def _compiler() -> str | None:
    return shutil.which("g++") or shutil.which("c++")


@cache
def _build_dir() -> Path:
    path = Path(tempfile.mkdtemp(prefix="metal-emulator-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def _compile(source: str) -> ctypes.CDLL:
    digest = hashlib.sha256(source.encode()).hexdigest()[:24]
    library = _build_dir() / f"kernel-{digest}.so"
    if not library.exists():
        path = library.with_suffix(".cpp")
        path.write_text(source)
        command = [_compiler(), "-std=c++20", "-O1", "-pthread", "-shared", "-fPIC"]
        command += ["-I", str(HERE), "-I", str(METAL_DIR), "-o", str(library), str(path)]
        result = subprocess.run(command, check=False, capture_output=True, text=True)
        if result.returncode:
            raise RuntimeError(f"the Metal source did not compile as C++:\n{result.stderr[-4000:]}")
    return ctypes.CDLL(str(library))


@cache
def available() -> bool:
    """A C++20 compiler with <barrier> (g++ 11 or later) is here."""
    if _compiler() is None:
        return False
    try:
        _compile('#include "metal_emulator.h"\nextern "C" int ok() { return 1; }\n')
    except RuntimeError:
        return False
    return True


def _template_line(name: str, value) -> str:
    if isinstance(value, mx.Dtype):
        return f"using {name} = {TYPES[value][0]};"
    if isinstance(value, bool):
        return f"constexpr bool {name} = {'true' if value else 'false'};"
    return f"constexpr int {name} = {int(value)};"


class EmulatedKernel:
    def __init__(self, name, input_names, output_names, source, header, ensure_row_contiguous):
        self.name, self.input_names, self.output_names = name, list(input_names), list(output_names)
        self.source, self.header, self.contiguous = source, header, ensure_row_contiguous

    def _program(self, template, input_types, output_types) -> str:
        params = []
        for name, dtype in zip(self.input_names, input_types, strict=True):
            params += [
                f"const {TYPES[dtype][0]}* {name}",
                f"const int* {name}_shape",
                f"const int64_t* {name}_strides",
                f"const int {name}_ndim",
            ]
        params += [f"{TYPES[d][0]}* {name}" for name, d in zip(self.output_names, output_types, strict=True)]
        positions = "\n".join(f"    const auto {p} = emulator_position_.{p};" for p in POSITIONS)
        args = []
        for i, dtype in enumerate(input_types):
            args += [
                f"(const {TYPES[dtype][0]}*)buffers[{i}]",
                f"shapes[{i}]",
                f"strides[{i}]",
                f"ndims[{i}]",
            ]
        first_output = len(self.input_names)
        args += [f"({TYPES[d][0]}*)buffers[{first_output + i}]" for i, d in enumerate(output_types)]
        constants = "\n".join(_template_line(name, value) for name, value in template)
        return f"""#include "metal_emulator.h"
{self.header}
namespace emulated {{
{constants}
void body({", ".join(params)}, const ThreadPosition& emulator_position_) {{
{positions}
    {{
{self.source}
    }}
}}
}}  // namespace emulated
extern "C" void launch(void** buffers, const int** shapes, const int64_t** strides, const int* ndims,
                       const unsigned* dims) {{
    run_grid({{dims[0], dims[1], dims[2]}}, {{dims[3], dims[4], dims[5]}}, [&](const ThreadPosition& at) {{
        emulated::body({", ".join(args)}, at);
    }});
}}
"""

    def _host(self, x: mx.array) -> np.ndarray:
        if x.ndim == 0:
            raise NotImplementedError("scalar inputs (passed by reference in Metal) are not emulated")
        if x.dtype == mx.bfloat16:
            x = x.view(mx.uint16)
        host = np.array(x, copy=False)  # MLX's buffer keeps the view's strides, as a kernel reads them
        return np.ascontiguousarray(host) if self.contiguous else host

    def __call__(
        self,
        *,
        inputs,
        template,
        grid,
        threadgroup,
        output_shapes,
        output_dtypes,
        init_value=None,
        verbose=False,
        stream=None,
    ):
        inputs = [x if isinstance(x, mx.array) else mx.array(x) for x in inputs]
        mx.eval(*inputs)
        hosts = [self._host(x) for x in inputs]
        outputs = []
        for shape, dtype in zip(output_shapes, output_dtypes, strict=True):
            out = np.empty(shape, TYPES[dtype][1])
            if init_value is None:
                out.view(np.uint8)[...] = 0xFF
            else:
                out[...] = init_value
            outputs.append(out)
        program = self._program(template, [x.dtype for x in inputs], list(output_dtypes))
        if verbose:
            print(program)
        library = _compile(program)
        n = len(hosts)
        buffers = (ctypes.c_void_p * (n + len(outputs)))(*[a.ctypes.data for a in hosts + outputs])
        shape_arrays = [np.array(a.shape, np.int32) for a in hosts]
        stride_arrays = [np.array([s // a.itemsize for s in a.strides], np.int64) for a in hosts]
        shapes = (ctypes.c_void_p * n)(*[a.ctypes.data for a in shape_arrays])
        strides = (ctypes.c_void_p * n)(*[a.ctypes.data for a in stride_arrays])
        ndims = (ctypes.c_int * n)(*[a.ndim for a in hosts])
        dims = (ctypes.c_uint * 6)(*grid, *threadgroup)
        with _LAUNCH_LOCK:
            library.launch(buffers, shapes, strides, ndims, dims)
        results = [mx.array(out) for out in outputs]
        return [
            r.view(mx.bfloat16) if d == mx.bfloat16 else r
            for r, d in zip(results, output_dtypes, strict=True)
        ]


def metal_kernel(
    name: str,
    input_names,
    output_names,
    source: str,
    header: str = "",
    ensure_row_contiguous: bool = True,
    atomic_outputs: bool = False,
):
    """mx.fast.metal_kernel's signature; the kernel runs on the CPU (see the module's doc)."""
    if atomic_outputs:
        raise NotImplementedError("atomic outputs are not emulated")
    return EmulatedKernel(name, input_names, output_names, source, header, ensure_row_contiguous)
