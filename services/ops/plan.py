"""`moe-mesh plan`: where a model's bytes will live, computed before anything loads.

From a split's manifest (or a checkpoint's lazily loaded shapes — no weight is read):
core bytes, every worker's owned / resident / streamed expert bytes under the budget,
the KV cache for the requested context, and the SSD bytes each token is expected to
read. The expectation assumes uniform routing, under which an LRU cache of s of the
n owned experts hits s/n of the time; real routers are skewed, so real traffic reads
less (bench/stream.py reports the measured hit rate).
"""

from __future__ import annotations

import json
from pathlib import Path

from services.common.manifest import Manifest, experts_per_token
from services.common.model_shape import kv_bytes_per_token, vision_model_type
from services.gateway.memory_bound import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_REQUEST_MEMORY_MB,
    MIB,
    gateway_bound_bytes,
)

GIB = 1 << 30


def _from_split(split: Path) -> dict:
    manifest = Manifest.load(split)
    core_bytes = sum(f.stat().st_size for f in (split / "core").glob("*.safetensors"))
    layers = [
        {
            "layer": layer.layer,
            "experts": layer.num_experts,
            "expert_bytes": sum(t.nbytes for t in layer.tensors),
            "record_size": layer.record_size,
        }
        for layer in manifest.layers
    ]
    return {"config": manifest.config, "core_bytes": core_bytes, "layers": layers, "source": "split manifest"}


def _from_checkpoint(path: Path) -> dict:
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    from services.common.checkpoint_layouts import model_classes
    from services.common.model_build import UnsupportedModelError, expert_modules, read_checkpoint_config

    if not (path / "config.json").is_file():
        raise ValueError(f"{path}: neither a split (manifest.json) nor a checkpoint (config.json)")
    read_checkpoint_config(path)
    model, config = load_model(
        path, lazy=True, get_model_classes=model_classes
    )  # shapes only: nothing is evaluated
    total = sum(a.nbytes for _, a in tree_flatten(model.parameters()))
    layers = []
    for order, (_, module) in enumerate(expert_modules(model)):
        params = [a for _, a in tree_flatten(module.parameters())]
        count = params[0].shape[0]
        per_expert = sum(a.nbytes for a in params) // count
        layers.append(
            {"layer": order, "experts": count, "expert_bytes": per_expert, "record_size": per_expert}
        )
    if not layers:
        raise UnsupportedModelError(f"{path.name} is a dense model: no routed experts")
    expert_total = sum(layer["experts"] * layer["expert_bytes"] for layer in layers)
    return {
        "config": config,
        "core_bytes": total - expert_total,
        "layers": layers,
        "source": "checkpoint shapes",
    }


def memory_plan(
    model: Path,
    memory_gb: float,
    workers: int = 1,
    context: int = 4096,
    seqs: int = 1,
    kv_element_bytes: float = 2.0,
    prefix_cache_gb: float = 1.0,
    mlx_cache_gb: float = 1.0,
    image_cache_gb: float = 1.0,
) -> dict:
    from services.common.model_source import resolve_model
    from services.tools.split_disk import split_bytes

    model = resolve_model(str(model))
    facts = _from_split(model) if (model / "manifest.json").exists() else _from_checkpoint(model)
    layers, config = facts["layers"], facts["config"]
    experts_per_layer = layers[0]["experts"]
    if not 1 <= workers <= experts_per_layer:
        raise ValueError(f"--workers must be between 1 and {experts_per_layer}")
    budget = int(memory_gb * 1e9)
    top_k = experts_per_token(config)
    bounds = [round(i * experts_per_layer / workers) for i in range(workers + 1)]
    plan_workers = []
    ssd_bytes_per_token = 0.0
    for w in range(workers):
        owned = bounds[w + 1] - bounds[w]
        shard = sum(owned * layer["expert_bytes"] for layer in layers)
        resident = min(budget, shard)
        fraction = resident / shard if shard else 1.0
        # Per layer, top_k of the layer's experts are routed; this worker owns owned/E of them.
        reads = sum(
            top_k * owned / layer["experts"] * (1 - fraction) * layer["record_size"] for layer in layers
        )
        ssd_bytes_per_token += reads
        plan_workers.append(
            {
                "worker": w,
                "experts": f"{bounds[w]}-{bounds[w + 1] - 1}",
                "shard_bytes": shard,
                "resident_bytes": resident,
                "streamed_bytes": shard - resident,
                "resident_fraction": round(fraction, 4),
                "expected_ssd_bytes_per_token": int(reads),
                # its resident experts and its MLX buffer-cache limit (`expert --mlx-cache-gb`)
                "bound_bytes": resident + int(mlx_cache_gb * GIB),
            }
        )
    kv_per_token, kv_note = kv_bytes_per_token(config, kv_element_bytes)
    expert_total = sum(layer["experts"] * layer["expert_bytes"] for layer in layers)
    kv_budget = int(kv_per_token * context * seqs)
    # core's memory: what it loads, the KV, and its two cache budgets (GiB, as core reads its flags)
    prefix_bytes, mlx_cache_bytes = int(prefix_cache_gb * GIB), int(mlx_cache_gb * GIB)
    # the vision tower's outputs kept by image: only a model that takes images has them
    image_bytes = int(image_cache_gb * GIB) if vision_model_type(config) else 0
    return {
        "model": str(model),
        "source": facts["source"],
        "model_type": config.get("model_type"),
        "core_bytes": facts["core_bytes"],
        "expert_bytes": expert_total,
        "moe_layers": len(layers),
        "experts_per_layer": experts_per_layer,
        "top_k": top_k,
        "memory_budget_bytes_per_worker": budget,
        "workers": plan_workers,
        "kv": {
            "bytes_per_token": int(kv_per_token),
            "context": context,
            "seqs": seqs,
            "budget_bytes": kv_budget,
            "estimate": kv_note,
        },
        "expected_ssd_bytes_per_token": int(ssd_bytes_per_token),
        "core_memory": {
            "prefix_cache_bytes": prefix_bytes,
            "mlx_cache_bytes": mlx_cache_bytes,
            "image_cache_bytes": image_bytes,
            "bound_bytes": facts["core_bytes"] + kv_budget + prefix_bytes + mlx_cache_bytes + image_bytes,
        },
        # the gateway's: connections and request bodies in flight at their defaults (memory_bound.py)
        "gateway_memory": {
            "max_connections": DEFAULT_MAX_CONNECTIONS,
            "request_memory_bytes": DEFAULT_REQUEST_MEMORY_MB * MIB,
            "bound_bytes": gateway_bound_bytes(),
        },
        # a checkpoint must be split first: the disk that takes (0 for a split)
        "split_disk_bytes": 0 if (model / "manifest.json").exists() else split_bytes(model),
        "assumption": "uniform routing; an LRU cache of s of n experts hits s/n of the time",
    }


def format_plan(plan: dict) -> str:
    gb = lambda n: f"{n / 1e9:.2f} GB"  # noqa: E731
    gib = lambda n: f"{n / GIB:g} GiB"  # noqa: E731
    lines = [
        f"{plan['model']} ({plan['model_type']}, from {plan['source']})",
        f"core (attention, embeddings, routers, shared experts): {gb(plan['core_bytes'])}",
        f"routed experts: {gb(plan['expert_bytes'])} = {plan['moe_layers']} MoE layers x "
        f"{plan['experts_per_layer']} experts, top-{plan['top_k']}",
        f"KV cache: {plan['kv']['bytes_per_token'] / 1e3:.1f} KB/token x {plan['kv']['context']} tokens x "
        f"{plan['kv']['seqs']} seqs = {gb(plan['kv']['budget_bytes'])} ({plan['kv']['estimate']})",
        f"core at most {gb(plan['core_memory']['bound_bytes'])}: weights + KV cache + prefix cache "
        f"{gib(plan['core_memory']['prefix_cache_bytes'])} + MLX buffer cache {gib(plan['core_memory']['mlx_cache_bytes'])}"
        + (
            f" + image cache {gib(plan['core_memory']['image_cache_bytes'])}"
            if plan["core_memory"]["image_cache_bytes"]
            else ""
        ),
        f"per worker, budget {gb(plan['memory_budget_bytes_per_worker'])}, at most its resident experts + "
        f"MLX buffer cache {gib(plan['core_memory']['mlx_cache_bytes'])}:",
    ]
    for w in plan["workers"]:
        lines.append(
            f"  worker {w['worker']} (experts {w['experts']}): shard {gb(w['shard_bytes'])}, resident "
            f"{gb(w['resident_bytes'])} ({w['resident_fraction']:.0%}), streamed {gb(w['streamed_bytes'])}, "
            f"~{w['expected_ssd_bytes_per_token'] / 1e6:.1f} MB/token from SSD, at most {gb(w['bound_bytes'])}"
        )
    gateway = plan["gateway_memory"]
    lines.append(
        f"gateway at most {gb(gateway['bound_bytes'])}: {gateway['max_connections']} connections "
        f"(--max-connections) + request bodies {gib(gateway['request_memory_bytes'])} (--max-request-memory-mb)"
    )
    lines.append(
        f"expected SSD reads: {plan['expected_ssd_bytes_per_token'] / 1e6:.1f} MB per token ({plan['assumption']})"
    )
    if plan["split_disk_bytes"]:
        lines.append(f"splitting it first writes {gb(plan['split_disk_bytes'])} to disk")
    return "\n".join(lines)


def plan_json(plan: dict) -> str:
    return json.dumps(plan, indent=1)
