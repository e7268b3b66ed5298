"""Before/after for core's expert dispatcher: this tree's against a git revision's, same worker, one run.

    python bench/dispatcher_ab.py --base a552b63 [--model demo] [--calls 400] [--workers 1]

Loads `services/core/expert_link/dispatcher.py` as it was at `--base` next to the current one, links both
to the same worker process(es) and alternates blocks of one-token layer calls between them, so
the machine's load (this box is shared) hits both alike. Prints one JSON object: p50/p99 µs of
the whole call, the worker's side and the transport (the rest) for each, and the differences.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.layer_call import interleaved
from bench.models import checkpoint
from bench.timing import percentiles
from bench.workdir import bench_workdir
from services.common.manifest import Manifest
from services.core.expert_link.dispatcher import ExpertDispatcher
from services.ops.up import expert_ranges, resolve_split
from tests.helpers import Workers


def dispatcher_class_at(revision: str, workdir: Path) -> type:
    """ExpertDispatcher as `services/core/expert_link/dispatcher.py` defined it at `revision`."""
    source = subprocess.run(
        ["git", "show", f"{revision}:services/core/expert_link/dispatcher.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    path = workdir / "expert_client_base.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("expert_client_base", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ExpertDispatcher


def summary(dispatcher, samples: list[float], calls: int) -> dict:
    rows = dispatcher.timings.snapshot()[-calls:]
    return {
        "call": percentiles(samples),
        "worker_side": percentiles(list(rows[:, 1])),
        "transport": percentiles(list(rows[:, 0] - rows[:, 1])),
    }


def main() -> None:
    from services.common.logging import configure_logging

    configure_logging("bench", "warning")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="git revision to compare with")
    parser.add_argument("--model", default="demo")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()

    split = resolve_split(str(checkpoint(args.model, args.dtype)))
    manifest = Manifest.load(split)
    layer = manifest.layers[0]
    k = manifest.experts_per_token
    hidden = mx.random.normal((1, manifest.hidden_size)).astype(mx.float32)
    rng = np.random.default_rng(0)
    ids = mx.array(rng.choice(layer.num_experts, size=(1, k), replace=False).astype(np.int32))
    mx.eval(hidden, ids)
    workdir = bench_workdir("mm-ab-")
    base_class = dispatcher_class_at(args.base, workdir)
    workers = Workers(split, workdir, expert_ranges(manifest.num_experts, args.workers)).start()
    dispatchers = {}
    try:
        for name, cls in (("base", base_class), ("current", ExpertDispatcher)):
            dispatchers[name] = cls(manifest, workers.addresses)
            assert dispatchers[name].discover() == [], name
        samples = interleaved(
            {name: (0.0, lambda d=d: d.call(layer.layer, hidden, ids)) for name, d in dispatchers.items()},
            args.calls,
        )
        report = {
            "bench": "dispatcher_ab",
            "model": args.model,
            "workers": args.workers,
            "base_revision": args.base,
            "current_revision": subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
            ).stdout.strip()
            + " + working tree",
            **{name: summary(d, samples[name], args.calls) for name, d in dispatchers.items()},
        }
    finally:
        for d in dispatchers.values():
            d.close()
        workers.stop()
    report["transport_p50_saved_us"] = round(
        report["base"]["transport"]["p50_us"] - report["current"]["transport"]["p50_us"], 1
    )
    report["call_p50_saved_us"] = round(
        report["base"]["call"]["p50_us"] - report["current"]["call"]["p50_us"], 1
    )
    # This box is shared: the load says how much the numbers can be trusted.
    report["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
