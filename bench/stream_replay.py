"""Offline replays of a worker's routing trace (one line per call: "layer expert expert ...").

- `replay_policies`: hit rate of each cache policy, with the store's own slot logic;
- `prefetch_bound`: how many misses "this layer's experts of the previous token" would predict;
- `replay_read_paths`: the trace's misses read through several RecordReader settings (threads,
  segment size), interleaved call by call and rotated over passes, so every setting reads every
  call once and the disk's drift hits all settings alike.
Used by bench/stream.py.
"""

from __future__ import annotations

import random
from pathlib import Path

from services.common.manifest import Manifest
from services.experts.cache_policy import make_policy
from services.experts.io import RecordRead, RecordReader, aligned_buffer


def load_trace(trace: Path) -> list[tuple[int, list[int]]]:
    return [
        (int(parts[0]), [int(e) for e in parts[1:]])
        for parts in (line.split() for line in trace.read_text().splitlines())
        if parts
    ]


def simulate(calls: list[tuple[int, list[int]]], slots: int, policy_name: str):
    """Replay `calls` through a `policy_name` cache of `slots` slots; per call yields (layer,
    experts, the keys resident before it, the keys it missed)."""
    policy, cached = make_policy(policy_name, slots), set()
    for layer, experts in calls:
        before, pinned, missed = set(cached), {(layer, e) for e in experts}, []
        for key in sorted(pinned, key=lambda k: k not in cached):  # hits first, as plan() orders
            if key not in cached:
                missed.append(key)
                if len(cached) >= slots:
                    victim = policy.victim(pinned)
                    cached.discard(victim)
                    policy.forget(victim)
                cached.add(key)
            policy.touch(key)
        yield layer, experts, before, missed


def misses_per_call(calls: list[tuple[int, list[int]]], slots: int, policy_name: str) -> list[list]:
    """Each call's missed (layer, expert) keys under `policy_name` with `slots` slots."""
    return [missed for *_, missed in simulate(calls, slots, policy_name)]


def replay_policies(trace: Path, slots: int) -> dict:
    """Hit rate of each policy on the recorded calls."""
    calls = load_trace(trace)
    total = sum(len(set(experts)) for _, experts in calls)
    rates = {}
    for name in ("lru", "lfu-decay"):
        missed = sum(len(m) for m in misses_per_call(calls, slots, name))
        rates[name] = round(1 - missed / total, 4) if total else 0.0
    return {"calls": len(calls), "hit_rate": rates}


def zipf_trace(path: Path, layers: int, experts: int, top_k: int, calls: int, skew: float = 1.0) -> Path:
    """A routing trace where expert popularity follows Zipf(skew), as real routers are skewed."""
    rng = random.Random(0)
    weights = [1.0 / (rank + 1) ** skew for rank in range(experts)]
    orders = [rng.sample(range(experts), experts) for _ in range(layers)]  # popularity per layer
    lines = []
    for _ in range(calls):
        for layer in range(layers):
            chosen: set[int] = set()
            while len(chosen) < top_k:
                chosen.add(orders[layer][rng.choices(range(experts), weights)[0]])
            lines.append(f"{layer} " + " ".join(map(str, sorted(chosen))))
    path.write_text("\n".join(lines))
    return path


def prefetch_bound(trace: Path, slots: int) -> dict:
    """Would "this layer's experts of the previous token" have prefetched the misses?"""
    previous: dict[int, set[int]] = {}
    predicted_misses = misses = predicted = 0
    for layer, experts, cached, missed in simulate(load_trace(trace), slots, "lru"):
        guess = previous.get(layer, set())
        predicted += len([e for e in guess if (layer, e) not in cached])  # what a prefetch would read
        misses += len(missed)
        predicted_misses += sum(expert in guess for _, expert in missed)
        previous[layer] = set(experts)
    return {
        "misses": misses,
        "misses_predicted": predicted_misses,
        "share_of_misses_predicted": round(predicted_misses / misses, 4) if misses else 0.0,
        "prefetch_reads_per_useful_read": round(predicted / predicted_misses, 2)
        if predicted_misses
        else None,
    }


def replay_read_paths(
    split: Path,
    trace: Path,
    slots: int,
    policy: str,
    settings: dict[str, tuple[int, int]],
    mode: str = "direct",
    small_call: int = 2,
) -> dict:
    """GB/s of each (threads, min segment bytes) setting on the trace's own misses.

    Reads land in page-aligned buffers laid out like the store's slab rows. Calls with at most
    `small_call` misses (decode-like) and the rest (prefill-like) are reported apart.
    """
    manifest = Manifest.load(split)
    layers = {layer.layer: layer for layer in manifest.layers}
    missed = [m for m in misses_per_call(load_trace(trace), slots, policy) if m]
    widest = max((len(m) for m in missed), default=0)
    tensors = manifest.layers[0].tensors
    buffers = [{t.name: aligned_buffer(t.nbytes) for t in tensors} for _ in range(widest)]
    names = list(settings)
    readers = {
        name: RecordReader(split, list(layers.values()), mode=mode, threads=t, min_segment_bytes=s)
        for name, (t, s) in settings.items()
    }
    totals = {name: {"small": [0, 0.0, 0], "large": [0, 0.0, 0]} for name in names}
    try:
        for turn in range(len(names)):  # every setting reads every call once, in rotated order
            for index, keys in enumerate(missed):
                name = names[(index + turn) % len(names)]
                reads = [
                    RecordRead(layer, expert, [(t.offset, buffers[i][t.name]) for t in layers[layer].tensors])
                    for i, (layer, expert) in enumerate(keys)
                ]
                nbytes, seconds, failures = readers[name].read_many(reads)
                if failures:
                    raise RuntimeError(failures[0][1])
                bucket = totals[name]["small" if len(keys) <= small_call else "large"]
                bucket[0] += nbytes
                bucket[1] += seconds
                bucket[2] += 1
    finally:
        for reader in readers.values():
            reader.close()
    return {
        name: {
            kind: {
                "calls": calls,
                "bytes": nbytes,
                "gbps": round(nbytes / seconds / 1e9, 3) if seconds else None,
            }
            for kind, (nbytes, seconds, calls) in buckets.items()
        }
        for name, buckets in totals.items()
    }
