"""`moe-mesh cluster check`: is this cluster.toml launchable?

Checks, in order: the split is there and matches `model.fingerprint` if one is given;
every routed expert of every MoE layer has at least one owner (replica counts are
reported); each worker's share against its `memory_gb` (over it, the worker streams
the rest from disk: a warning); and, for each worker that is
already up, Describe says it serves the model with that fingerprint and the experts
the file gives it. Workers that are down are checked against the manifest only, and
the report says so. Errors make the check fail; warnings (no TLS on a non-loopback
address, which the services then refuse without --insecure; single owners) do not.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc
import numpy as np

from services.common.grpc_util import aio_channel, is_loopback
from services.common.manifest import Manifest, ManifestError
from services.common.ranges import format_ranges
from services.ops.cluster import ClusterConfig
from services.proto.moemesh.v1 import expert_pb2, expert_pb2_grpc

GB = 1 << 30


@dataclass
class CheckReport:
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors

    def lines(self) -> list[str]:
        return (
            [f"error: {e}" for e in self.errors]
            + [f"warning: {w}" for w in self.warnings]
            + [f"ok: {n}" for n in self.notes]
        )


def check_cluster(config: ClusterConfig, probe: bool = True, timeout_s: float = 3.0) -> CheckReport:
    report = CheckReport()
    try:
        manifest = Manifest.load(config.split)
    except (ManifestError, OSError) as error:
        report.errors.append(f"model.split {config.split}: {error}")
        return report
    if config.fingerprint and config.fingerprint != manifest.fingerprint:
        report.errors.append(
            f"model.fingerprint {config.fingerprint} but the split at {config.split} is {manifest.fingerprint}"
        )
    report.notes.append(
        f"model {manifest.model_type} {manifest.fingerprint}: {len(manifest.layers)} MoE layers x {manifest.num_experts} experts"
    )
    owned = _coverage(config, manifest, report)
    _settings(config, report)
    _budgets(config, manifest, owned, report)
    _security(config, report)
    if probe:
        asyncio.run(_probe_workers(config, manifest, owned, report, timeout_s))
    return report


def _settings(config: ClusterConfig, report: CheckReport) -> None:
    """What core and workers would refuse at start, found before anything starts."""
    from services.core.kv.settings import KV_CACHE_KINDS  # (imports MLX: only here, not in every service)

    if config.core.kv_cache not in KV_CACHE_KINDS:
        report.errors.append(f"core.kv_cache {config.core.kv_cache!r}: one of {', '.join(KV_CACHE_KINDS)}")
    seen: dict[str, str] = {}
    for worker in config.workers:
        if worker.address in seen:
            report.errors.append(
                f"workers {seen[worker.address]} and {worker.name} share the address {worker.address}"
            )
        seen.setdefault(worker.address, worker.name)


def _coverage(config: ClusterConfig, manifest: Manifest, report: CheckReport) -> dict[str, dict]:
    owners = {layer.layer: np.zeros(layer.num_experts, dtype=np.int32) for layer in manifest.layers}
    owned: dict[str, dict[int, list[int]]] = {}
    for worker in config.workers:
        try:
            owned[worker.name] = worker.owned(manifest.layer_indices, manifest.num_experts)
        except ValueError as error:
            report.errors.append(f"worker {worker.name}: {error}")
            continue
        for layer, experts in owned[worker.name].items():
            owners[layer][experts] += 1
    single = 0
    for layer, count in sorted(owners.items()):
        missing = np.flatnonzero(count == 0).tolist()
        if missing:
            report.errors.append(f"layer {layer} experts {format_ranges(missing)} have no owner")
        single += int((count == 1).sum())
    total = sum(len(c) for c in owners.values())
    fewest = min(int(c.min()) for c in owners.values())
    if not any(e.startswith("layer ") for e in report.errors):
        report.notes.append(
            f"every routed expert has an owner ({total} pairs; fewest replicas {fewest}, most {max(int(c.max()) for c in owners.values())})"
        )
    if single and len(config.workers) > 1:
        report.warnings.append(
            f"{single} of {total} (layer, expert) pairs have a single owner: losing that worker fails requests"
        )
    return owned


def _budgets(config: ClusterConfig, manifest: Manifest, owned: dict, report: CheckReport) -> None:
    record = {layer.layer: layer.record_size for layer in manifest.layers}
    for worker in config.workers:
        shard = owned.get(worker.name)
        if shard is None:
            continue
        held = sum(record[layer] * len(experts) for layer, experts in shard.items())
        if worker.memory_gb is None:
            report.notes.append(f"worker {worker.name}: {held / GB:.2f} GB of experts (no memory_gb budget)")
        elif held > worker.memory_gb * GB:
            report.warnings.append(
                f"worker {worker.name} serves {held / GB:.2f} GB of experts with memory_gb {worker.memory_gb:g}: "
                f"{(held - worker.memory_gb * GB) / GB:.2f} GB stream from disk on demand (slower)"
            )
        else:
            report.notes.append(
                f"worker {worker.name}: {held / GB:.2f} GB of experts fits memory_gb {worker.memory_gb:g}"
            )


def _security(config: ClusterConfig, report: CheckReport) -> None:
    if config.tls_dir is not None:
        for name in ["core", "gateway", *(w.name for w in config.remote_workers)]:
            files = config.tls_for(name)
            absent = [str(p) for p in (files.ca, files.cert, files.key) if not p.exists()]
            if absent:
                report.errors.append(
                    f"TLS files for {name} are missing: {', '.join(absent)} (run `moe-mesh certs --config {config.path}`)"
                )
        return
    exposed = [w.listen for w in config.remote_workers if not is_loopback(w.listen)]
    if not is_loopback(config.core.listen):
        exposed.append(config.core.listen)
    if exposed:
        report.warnings.append(
            f"{', '.join(exposed)} reachable from other hosts without TLS: those services refuse to "
            "start unless given --insecure; add [tls] (moe-mesh certs)"
        )


async def _probe_workers(
    config: ClusterConfig, manifest: Manifest, owned: dict, report: CheckReport, timeout_s: float
) -> None:
    tls = config.tls_for("core")
    if tls is not None and not all(p.exists() for p in (tls.ca, tls.cert, tls.key)):
        return  # reported by _security

    async def describe(worker):
        async with aio_channel(worker.address, tls) as channel:
            return await expert_pb2_grpc.ExpertWorkerStub(channel).Describe(
                expert_pb2.DescribeRequest(), timeout=timeout_s
            )

    workers = config.remote_workers  # the local one lives in core: nothing to describe
    replies = await asyncio.gather(*(describe(w) for w in workers), return_exceptions=True)
    for worker, reply in zip(workers, replies, strict=True):
        if isinstance(reply, grpc.aio.AioRpcError):
            report.notes.append(
                f"worker {worker.name} at {worker.address} is not up ({reply.code().name}); checked against the manifest only"
            )
            continue
        if isinstance(reply, BaseException):
            report.errors.append(f"worker {worker.name} at {worker.address}: {reply!r}")
            continue
        if reply.model_fingerprint != manifest.fingerprint:
            report.errors.append(
                f"worker {worker.name} serves model {reply.model_fingerprint}, the split is {manifest.fingerprint}"
            )
            continue
        served = {held.layer: sorted(held.experts) for held in reply.layers}
        expected = owned.get(worker.name, {})
        if served != expected:
            differ = sorted(set(served) ^ set(expected) | {k for k in served if served[k] != expected.get(k)})
            report.errors.append(
                f"worker {worker.name} is up but serves other experts than cluster.toml gives it (layers {format_ranges(differ)})"
            )
        else:
            report.notes.append(f"worker {worker.name} is up with fingerprint {reply.model_fingerprint}")
