"""What core's evaluation before each expert hop costs on its own, in one process.

    python bench/layer_sync.py [--model qwen3-30b-a3b-4layer] [--dtype bfloat16] [--steps 200]

mlx-lm's model with every expert module replaced by one that evaluates its inputs (as core's
`RemoteExperts` does before a hop, timed) and answers at once, in one process with nothing else on
the device. Variants: the answer already on the device (`synced_per_layer`); made from host bytes as
core makes a worker's answer (`answers_from_host`, host staging as configured); and, besides, the
evaluated inputs read to the host as core reads what it sends, through the pointer
(`inputs_read_by_view`) or by the copy engine (`inputs_read_by_copy_engine`, CUDA only). Also the
decode step with no evaluation but the token's (`one_eval_per_step`) and the price of evaluating one
tiny op (`empty_eval_p50_us`). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx import nn
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decode import checkpoint
from services.common import tensor_codec
from services.common.host_staging import MemoryAdvisor
from services.common.model_build import expert_modules
from services.common.module_paths import replace_modules

ADVISOR = MemoryAdvisor.find()  # the CUDA driver's copy engine; None elsewhere


def read_by_copy_engine(array: mx.array) -> np.ndarray:
    view = np.asarray(array)  # a view: no page is read through it
    host = np.empty_like(view)
    if not ADVISOR.copy_to_host(host.ctypes.data, view.ctypes.data, view.nbytes):
        raise RuntimeError("cuMemcpyDtoH failed")
    return host


class SyncedZeros(nn.Module):
    def __init__(self, hidden: int, dtype, times: list, sync: bool, from_host: bool = False, read: str = ""):
        super().__init__()
        self._hidden, self._dtype, self._times, self._sync = hidden, dtype, times, sync
        self._from_host, self._read = from_host, read
        self._zeros = {}

    def __call__(self, x, indices):
        shape = (*indices.shape, self._hidden)
        if self._sync:
            flat_x = x.reshape(-1, x.shape[-1])
            flat_ids = indices.reshape(-1, indices.shape[-1]).astype(mx.int32)
            started = time.perf_counter()
            mx.eval(flat_x, flat_ids)
            self._times.append((time.perf_counter() - started) * 1e6)
            if self._read == "view":  # as core reads what it sends: through the pointer
                np.asarray(tensor_codec.wire_form(flat_x)).tobytes(), np.asarray(flat_ids).tobytes()
            elif self._read == "copy_engine":
                read_by_copy_engine(tensor_codec.wire_form(flat_x)), read_by_copy_engine(flat_ids)
        if self._from_host:  # as core's answer arrives: host bytes made an MLX array
            host = np.zeros(shape, dtype=np.uint16 if self._dtype == mx.bfloat16 else np.float32)
            return tensor_codec.to_mlx(host)
        zeros = self._zeros.get(shape)
        if zeros is None:
            zeros = self._zeros[shape] = mx.zeros(shape, dtype=self._dtype)
            mx.eval(zeros)
        return zeros


def run(model, steps: int, sync: bool, from_host: bool = False, read: str = "") -> dict:
    from mlx_lm.models.cache import make_prompt_cache

    times: list[float] = []
    floats = (mx.float32, mx.float16, mx.bfloat16)
    dtype = next(v.dtype for _, v in tree_flatten(model.parameters()) if v.dtype in floats)
    hidden = model.args.hidden_size
    replace_modules(
        model,
        {path: SyncedZeros(hidden, dtype, times, sync, from_host, read) for path, _ in expert_modules(model)},
    )
    cache = make_prompt_cache(model)
    prompt = mx.array([list(range(1000, 1024))])
    mx.eval(model(prompt, cache=cache))
    token = mx.array([[1000]])
    step_us = []
    for i in range(steps + 20):
        if i == 20:
            times.clear()
        started = time.perf_counter()
        logits = model(token, cache=cache)
        token = mx.argmax(logits[:, -1:], axis=-1)
        mx.eval(token)
        if i >= 20:
            step_us.append((time.perf_counter() - started) * 1e6)
    out = {"step_p50_us": round(float(np.percentile(step_us, 50)), 1)}
    if sync:
        out["layer_sync_p50_us"] = round(float(np.percentile(times, 50)), 1)
        out["layer_sync_p90_us"] = round(float(np.percentile(times, 90)), 1)
    return out


def empty_eval_us(calls: int = 300) -> float:
    """p50 of evaluating one tiny op: the fixed price of a synchronisation on this device."""
    x = mx.zeros((1,))
    mx.eval(x)
    times = []
    for i in range(calls + 20):
        started = time.perf_counter()
        x = x + 1
        mx.eval(x)
        if i >= 20:
            times.append((time.perf_counter() - started) * 1e6)
    return round(float(np.percentile(times, 50)), 1)


def main() -> None:
    import mlx_lm

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-30b-a3b-4layer")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    path = checkpoint(args.model, args.dtype)
    report = {
        "bench": "layer_sync",
        "model": args.model,
        "dtype": args.dtype,
        "device": str(mx.default_device()),
    }
    report["empty_eval_p50_us"] = empty_eval_us()
    variants = (
        ("synced_per_layer", True, False, ""),
        ("answers_from_host", True, True, ""),
        ("inputs_read_by_view", True, True, "view"),
        ("inputs_read_by_copy_engine", True, True, "copy_engine"),
        ("one_eval_per_step", False, False, ""),
    )
    for name, sync, from_host, read in variants:
        if read == "copy_engine" and ADVISOR is None:
            continue
        model, _ = mlx_lm.load(str(path))
        report[name] = run(model, args.steps, sync, from_host, read)
        del model
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
