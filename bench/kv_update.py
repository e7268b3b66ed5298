"""Ways to write one decode step's token into a preallocated KV buffer, per layer call.

    python bench/kv_update.py [--layers 30] [--steps 30]

A decode step appends one token to every layer's keys and values. On a GPU each op of
that append is a launch and host work, which a small model's step cannot hide, so the
way the write is expressed shows in tok/s. Each way writes [1, 3, 1, 64] float16 into
`--layers` pairs of [1, 3, 256, 64] buffers, one evaluation per step (as a decode step
runs); median per layer call of host µs (building the graph) and step µs (build, run,
wait). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.timing import step_split_us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    update = mx.random.normal((1, 3, 1, 64)).astype(mx.float16)
    index = [mx.array([i], mx.int32) for i in range(args.steps)]  # made before timing

    def dynamic(a, i):  # mx.slice_update with an index array: what TokenBuffer does
        return mx.slice_update(a, update, index[i], (2,))

    def dynamic_with_astype(a, i):  # the same after a same-dtype astype
        return mx.slice_update(a, update.astype(a.dtype), index[i], (2,))

    def static_on_new_handle(a, i):  # a static write that leaves `a` itself as it was
        out = mx.stop_gradient(a)
        out[:, :, i : i + 1] = update
        return out

    def static_in_place(a, i):  # mlx-lm's KVCache: the Python object itself changes
        a[:, :, i : i + 1] = update
        return a

    rows = {}
    for way in (dynamic, dynamic_with_astype, static_on_new_handle, static_in_place):
        buffers = [[mx.zeros((1, 3, 256, 64), mx.float16) for _ in range(2)] for _ in range(args.layers)]
        mx.eval(buffers)

        def step(i, way=way, buffers=buffers):
            buffers[:] = [[way(a, i) for a in pair] for pair in buffers]
            return buffers

        host, step_us = step_split_us(step, args.steps, args.layers)
        rows[way.__name__] = {"host_us": host, "step_us": step_us}
    print(json.dumps({"bench": "kv_update", "device": str(mx.default_device()), "per_layer_call": rows}))


if __name__ == "__main__":
    main()
