"""Host bytes into and out of a GPU computation on MLX's CUDA backend, five ways, interleaved.

    python bench/host_staging.py          # on a machine with MLX's CUDA backend

Each call writes rows x 2048 float32 from the host, multiplies them by a 2048 x 6144 bf16 matrix
and reads the result back. The input comes as a fresh `mx.array` (`fresh`), as one reused buffer
written in place (`persist`), as that buffer advised to stay in host memory (`pref_cpu`), to be
mapped by the GPU (`accessed`), or both (`pref_cpu_accessed`, what services/common/host_staging.py
does), or already on the device (`device`, the floor). p50 µs of write, evaluate and read, and of
reading results through numpy (page faults) against `cuMemcpyDtoH` (the copy engine).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from services.common.host_staging import MemoryAdvisor

MODES = ("fresh", "persist", "pref_cpu", "accessed", "pref_cpu_accessed", "device")
ADVICE = {  # mode -> (host_resident, device_mapped)
    "pref_cpu": (True, False),
    "accessed": (False, True),
    "pref_cpu_accessed": (True, True),
}


def persistent(shape, mode: str, advisor: MemoryAdvisor):
    array = mx.zeros(shape, dtype=mx.float32)
    mx.eval(array)
    view = np.frombuffer(memoryview(array), dtype=np.float32).reshape(shape)
    if mode in ADVICE:
        advisor.advise(view.ctypes.data, view.nbytes, *ADVICE[mode])
    return array, view


def inputs(rows: int, weight: mx.array, advisor: MemoryAdvisor, calls: int) -> dict:
    shape = (rows, weight.shape[0])
    rng = np.random.default_rng(0)
    stores = {m: persistent(shape, m, advisor) for m in MODES if m not in ("fresh", "device")}
    samples: dict[str, list] = {m: [] for m in MODES}
    for call in range(calls + 100):
        host = rng.standard_normal(shape).astype(np.float32)
        reference = None
        for mode in MODES:
            if mode == "device":
                x = mx.random.normal(shape)
                mx.eval(x)
            started = time.perf_counter()
            if mode == "fresh":
                x = mx.array(host)
            elif mode != "device":
                x, view = stores[mode]
                view[...] = host
            written = time.perf_counter()
            y = (x.astype(mx.bfloat16) @ weight).astype(mx.float32)
            mx.eval(y)
            evaluated = time.perf_counter()
            out = np.array(y)
            read = time.perf_counter()
            if call >= 100:
                samples[mode].append(
                    (written - started, evaluated - written, read - evaluated, read - started)
                )
            if mode != "device":
                reference = out if reference is None else reference
                assert np.array_equal(out, reference), mode
    report = {}
    for mode, rows_of in samples.items():
        p50 = np.median(np.array(rows_of) * 1e6, axis=0)
        report[mode] = dict(
            zip(("write", "eval", "read", "total"), (round(float(v), 1) for v in p50), strict=True)
        )
    return report


def reads(rows: int, weight: mx.array, advisor: MemoryAdvisor, calls: int) -> dict:
    x = mx.random.normal((rows, weight.shape[0]))
    mx.eval(x)
    host = np.empty((rows, weight.shape[1]), np.float32)
    through_numpy, copy_engine = [], []
    for call in range(calls + 100):
        y = (x.astype(mx.bfloat16) @ weight).astype(mx.float32)
        mx.eval(y)
        started = time.perf_counter()
        faulted = np.array(y)
        done = time.perf_counter()
        y = (x.astype(mx.bfloat16) @ weight).astype(mx.float32)
        mx.eval(y)
        source = np.asarray(y).ctypes.data
        copy_started = time.perf_counter()
        if not advisor.copy_to_host(host.ctypes.data, source, host.nbytes):
            raise OSError("cuMemcpyDtoH failed")
        copied = time.perf_counter()
        assert np.array_equal(faulted, host)
        if call >= 100:
            through_numpy.append((done - started) * 1e6)
            copy_engine.append((copied - copy_started) * 1e6)
    return {
        "bytes": host.nbytes,
        "numpy_p50_us": round(float(np.median(through_numpy)), 1),
        "copy_engine_p50_us": round(float(np.median(copy_engine)), 1),
    }


def main() -> None:
    advisor = MemoryAdvisor.find()
    if advisor is None:
        sys.exit("this bench needs MLX's CUDA backend")
    weight = (mx.random.normal((2048, 768 * 8)) * 0.02).astype(mx.bfloat16)
    mx.eval(weight)
    report = {"bench": "host_staging", "mlx": mx.__version__, "device": str(mx.default_device())}
    for rows in (1, 8, 64):
        report[f"inputs_{rows}x2048"] = inputs(rows, weight, advisor, 700)
        print(f"[bench] inputs {rows} rows done", file=sys.stderr, flush=True)
    for rows in (1, 8, 64):
        report[f"reads_{rows}x6144"] = reads(rows, weight, advisor, 500)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
