"""`cluster.toml`: one file describes a deployment; every service reads it plus its role.

```toml
[model]
split = "/srv/moe-mesh/qwen3-235b-split"   # same path on every host (relative = to this file)

[core]
listen = "10.0.0.1:50051"                  # where the gateway reaches core
metrics = "127.0.0.1:9101"                 # optional Prometheus endpoint
expert_timeout_s = 60

[gateway]
host = "127.0.0.1"
port = 8000

[tls]                                      # optional: mTLS on every gRPC link
dir = "certs"                              # from `moe-mesh certs --config cluster.toml`

[data_plane]                               # optional: layer calls as collectives (services/common/data_plane.py)
backend = "jaccl"                          # ring | nccl | jaccl; ranks: core 0, the workers in file order

[environment]                              # the same on every host: MLX's variables for the group
MLX_IBV_DEVICES = "/etc/moe-mesh/ibv-devices.json"
MLX_JACCL_COORDINATOR = "10.0.0.1:32323"

[[workers]]
name = "mac-a"
address = "10.0.0.2:50061"                 # where core reaches it; "local": in core's process
listen = "0.0.0.0:50061"                   # optional, default = address
layers = "all"
experts = "0-63"
memory_gb = 48                             # optional budget for this worker's experts
metrics = "127.0.0.1:9102"
```

An expert may be listed by several workers (replicas): core balances over them and
fails over between them. The config is typed and frozen; every error names the key
and the file, so a bad file is one clear line, never a traceback at runtime.
"""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from services.common.data_plane_flag import BACKENDS
from services.common.ranges import parse_ranges
from services.common.tls import TlsFiles

ROLES = ("core", "gateway", "worker")
LOCAL_ADDRESS = "local"  # a worker at this address runs inside core (services/core/expert_link/local.py)


class ClusterConfigError(ValueError):
    """cluster.toml is malformed: the message names the file and the key."""


@dataclass(frozen=True)
class WorkerConfig:
    name: str
    address: str  # how core reaches it
    listen: str  # what it binds
    layers: str = "all"
    experts: str = "all"
    memory_gb: float | None = None
    metrics: str | None = None
    worker_id: str | None = None

    @property
    def is_local(self) -> bool:
        """`address = "local"`: core computes this worker's experts in its own process."""
        return self.address == LOCAL_ADDRESS

    def owned(self, moe_layers: list[int], num_experts: int) -> dict[int, list[int]]:
        """(layer -> experts) this worker serves, for a model with these MoE layers."""
        layer_ids = set(moe_layers)
        chosen = parse_ranges(self.layers, max(layer_ids) + 1, f"workers.{self.name}.layers")
        experts = parse_ranges(self.experts, num_experts, f"workers.{self.name}.experts")
        return {layer: experts for layer in chosen if layer in layer_ids}


@dataclass(frozen=True)
class CoreConfig:
    listen: str = "127.0.0.1:50051"
    metrics: str | None = None
    expert_timeout_s: float = 60.0
    max_num_seqs: int = 16
    max_queue: int = 256
    max_num_batched_tokens: int = 512
    max_step_seconds: float = 1.0
    micro_batches: int = 1
    burst_gather_ms: float = 2.0
    prefix_cache_gb: float = 1.0
    image_cache_gb: float = 1.0
    mlx_cache_gb: float = 1.0
    kv_cache: str = "fp16"
    speculative: str | None = None  # "ngram" | "draft:PATH"; None: off
    num_speculative_tokens: int | None = None


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    core: str | None = None  # default: core.listen


@dataclass(frozen=True)
class ClusterConfig:
    path: Path
    split: Path
    core: CoreConfig
    gateway: GatewayConfig
    workers: tuple[WorkerConfig, ...]
    tls_dir: Path | None = None
    fingerprint: str | None = None  # optional: the model every service must hold
    environment: dict[str, str] = field(default_factory=dict)
    data_plane: str | None = None  # the mx.distributed backend of the data plane, if any

    def data_plane_environment(self, worker: str | None = None) -> dict[str, str]:
        """What a service's process needs to join the data plane: [environment], plus its rank
        (core 0, `worker` its place among the remote workers plus one) and the group's size."""
        remote = [w.name for w in self.remote_workers]
        rank = 0 if worker is None else remote.index(worker) + 1
        return {**self.environment, "MLX_RANK": str(rank), "MLX_WORLD_SIZE": str(len(remote) + 1)}

    def worker(self, name: str) -> WorkerConfig:
        for worker in self.workers:
            if worker.name == name:
                return worker
        names = ", ".join(w.name for w in self.workers)
        raise ClusterConfigError(f"{self.path}: no worker named {name!r} (workers: {names})")

    def tls_for(self, name: str) -> TlsFiles | None:
        """The CA and this service's certificate (`core`, `gateway` or a worker's name)."""
        if self.tls_dir is None:
            return None
        return TlsFiles.in_dir(self.tls_dir, name)

    @property
    def gateway_core_target(self) -> str:
        return self.gateway.core or self.core.listen

    @property
    def worker_addresses(self) -> list[str]:
        """Where core reaches its expert worker processes (the local worker has none)."""
        return [worker.address for worker in self.remote_workers]

    @property
    def remote_workers(self) -> tuple[WorkerConfig, ...]:
        """The workers that run as processes of their own (every one but `address = "local"`)."""
        return tuple(worker for worker in self.workers if not worker.is_local)

    @property
    def local_worker(self) -> WorkerConfig | None:
        """The worker whose experts core computes in its own process, if one is configured."""
        return next((worker for worker in self.workers if worker.is_local), None)


def load_cluster(path: str | Path) -> ClusterConfig:
    path = Path(path).expanduser().resolve()
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        raise ClusterConfigError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ClusterConfigError(f"{path}: is a folder, not a cluster.toml") from None
    return cluster_from_toml(text, path)


def cluster_from_toml(text: bytes, path: Path) -> ClusterConfig:
    """The cluster `text` describes (read from `path`); ClusterConfigError naming what is wrong."""
    try:
        data = tomllib.loads(text.decode())
    except UnicodeDecodeError as error:
        raise ClusterConfigError(f"{path}: not UTF-8 text: {error}") from None
    except tomllib.TOMLDecodeError as error:
        raise ClusterConfigError(f"{path}: not valid TOML: {error}") from None
    return parse_cluster(data, path)


def parse_cluster(data: dict, path: Path) -> ClusterConfig:
    reader = _Reader(path)
    known = {"model", "core", "gateway", "tls", "workers", "environment", "data_plane"}
    reader.no_unknown(data, known, "")
    model = reader.table(data, "model")
    reader.no_unknown(model, {"split", "fingerprint"}, "model.")
    split = reader.path(model, "split", "model.split", required=True)

    core_table = reader.table(data, "core", required=False)
    reader.no_unknown(core_table, set(CoreConfig.__dataclass_fields__), "core.")
    core = CoreConfig(
        listen=reader.string(core_table, "listen", "core.listen", CoreConfig.listen),
        metrics=reader.string(core_table, "metrics", "core.metrics", None),
        expert_timeout_s=reader.number(core_table, "expert_timeout_s", "core.expert_timeout_s", 60.0),
        max_num_seqs=int(reader.number(core_table, "max_num_seqs", "core.max_num_seqs", 16)),
        max_queue=int(reader.number(core_table, "max_queue", "core.max_queue", 256)),
        max_num_batched_tokens=int(
            reader.number(core_table, "max_num_batched_tokens", "core.max_num_batched_tokens", 512)
        ),
        max_step_seconds=reader.non_negative(core_table, "max_step_seconds", "core.max_step_seconds", 1.0),
        micro_batches=int(reader.number(core_table, "micro_batches", "core.micro_batches", 1)),
        burst_gather_ms=reader.non_negative(
            core_table, "burst_gather_ms", "core.burst_gather_ms", CoreConfig.burst_gather_ms
        ),
        prefix_cache_gb=reader.non_negative(core_table, "prefix_cache_gb", "core.prefix_cache_gb", 1.0),
        image_cache_gb=reader.non_negative(core_table, "image_cache_gb", "core.image_cache_gb", 1.0),
        mlx_cache_gb=reader.non_negative(
            core_table, "mlx_cache_gb", "core.mlx_cache_gb", CoreConfig.mlx_cache_gb
        ),
        kv_cache=reader.string(core_table, "kv_cache", "core.kv_cache", "fp16"),
        speculative=reader.string(core_table, "speculative", "core.speculative", None),
        num_speculative_tokens=int(
            reader.number(core_table, "num_speculative_tokens", "core.num_speculative_tokens", 4)
        )
        if "num_speculative_tokens" in core_table
        else None,
    )
    gateway_table = reader.table(data, "gateway", required=False)
    reader.no_unknown(gateway_table, {"host", "port", "core"}, "gateway.")
    gateway = GatewayConfig(
        host=reader.string(gateway_table, "host", "gateway.host", "127.0.0.1"),
        port=reader.port(gateway_table, "port", "gateway.port", 8000),
        core=reader.string(gateway_table, "core", "gateway.core", None),
    )
    tls_table = reader.table(data, "tls", required=False)
    reader.no_unknown(tls_table, {"dir"}, "tls.")
    tls_dir = reader.path(tls_table, "dir", "tls.dir", required=bool(tls_table))

    raw_workers = data.get("workers", [])
    if not isinstance(raw_workers, list) or not raw_workers:
        raise ClusterConfigError(f"{path}: at least one [[workers]] entry is needed")
    workers = []
    seen: set[str] = set()
    for index, raw in enumerate(raw_workers):
        where = f"workers[{index}]."
        if not isinstance(raw, dict):
            raise ClusterConfigError(f"{path}: {where[:-1]} must be a table")
        reader.no_unknown(
            raw,
            {"name", "address", "listen", "layers", "experts", "memory_gb", "metrics", "worker_id"},
            where,
        )
        name = reader.string(raw, "name", where + "name", f"worker-{index}")
        if name in seen or name in ("core", "gateway", "ca"):
            raise ClusterConfigError(f"{path}: {where}name {name!r} is used twice or reserved")
        seen.add(name)
        address = reader.string(raw, "address", where + "address", None)
        if not address:
            raise ClusterConfigError(f"{path}: {where}address is required (host:port or unix:/path)")
        listen = reader.string(raw, "listen", where + "listen", address)
        if address == LOCAL_ADDRESS:
            if any(w.address == LOCAL_ADDRESS for w in workers):
                raise ClusterConfigError(f'{path}: {where}address: only one worker may be "local"')
            if str(raw.get("experts", "all")).strip() not in ("", "all"):
                raise ClusterConfigError(
                    f'{path}: {where}experts: the local worker serves whole layers (experts = "all")'
                )
        for key, value in (("address", address), ("listen", listen)):
            if value == LOCAL_ADDRESS:
                continue
            try:
                check_address(value)
            except ValueError as error:
                raise ClusterConfigError(f"{path}: {where}{key}: {error}") from None
        memory = raw.get("memory_gb")
        if memory is not None and (not _finite(memory) or memory <= 0):
            raise ClusterConfigError(f"{path}: {where}memory_gb must be a positive number")
        workers.append(
            WorkerConfig(
                name=name,
                address=address,
                listen=listen,
                layers=str(raw.get("layers", "all")),
                experts=str(raw.get("experts", "all")),
                memory_gb=float(memory) if memory is not None else None,
                metrics=reader.string(raw, "metrics", where + "metrics", None),
                worker_id=reader.string(raw, "worker_id", where + "worker_id", None),
            )
        )
    environment = data.get("environment", {})
    if not isinstance(environment, dict) or not all(isinstance(v, str) for v in environment.values()):
        raise ClusterConfigError(f"{path}: [environment] must map names to strings")
    plane_table = reader.table(data, "data_plane", required=False)
    reader.no_unknown(plane_table, {"backend"}, "data_plane.")
    data_plane = reader.string(plane_table, "backend", "data_plane.backend", None)
    if data_plane is not None and data_plane not in BACKENDS:
        raise ClusterConfigError(
            f"{path}: data_plane.backend must be one of {', '.join(BACKENDS)}, got {data_plane!r}"
        )
    return ClusterConfig(
        path=path,
        split=split,
        core=core,
        gateway=gateway,
        workers=tuple(workers),
        tls_dir=tls_dir,
        fingerprint=reader.string(model, "fingerprint", "model.fingerprint", None),
        environment=dict(environment),
        data_plane=data_plane,
    )


def split_host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{address!r} is not host:port (a port is 1-65535)")
    return host.strip("[]"), int(port)


def check_address(address: str) -> str:
    """`address` when it is unix:/PATH or host:port with a real port; ValueError naming it otherwise."""
    if not address.startswith("unix:"):
        split_host_port(address)
    return address


def _finite(value) -> bool:
    """A TOML number that is not a bool, inf or nan."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


class _Reader:
    """Typed reads from a TOML table, each error naming the file and the key."""

    def __init__(self, file: Path):
        self.file = file

    def fail(self, message: str):
        raise ClusterConfigError(f"{self.file}: {message}")

    def no_unknown(self, table: dict, known: set[str], prefix: str) -> None:
        unknown = sorted(set(table) - known)
        if unknown:
            self.fail(f"unknown key {prefix}{unknown[0]} (known: {', '.join(sorted(known))})")

    def table(self, data: dict, key: str, required: bool = True) -> dict:
        value = data.get(key)
        if value is None:
            if required:
                self.fail(f"[{key}] is missing")
            return {}
        if not isinstance(value, dict):
            self.fail(f"{key} must be a table")
        return value

    def string(self, table: dict, key: str, name: str, default):
        value = table.get(key, default)
        if value is not None and not isinstance(value, str):
            self.fail(f"{name} must be a string")
        return value

    def number(self, table: dict, key: str, name: str, default: float) -> float:
        value = table.get(key, default)
        if not _finite(value) or value <= 0:
            self.fail(f"{name} must be a positive number")
        return value

    def port(self, table: dict, key: str, name: str, default: int) -> int:
        value = table.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
            self.fail(f"{name} must be a port number (1-65535)")
        return value

    def non_negative(self, table: dict, key: str, name: str, default: float) -> float:
        value = table.get(key, default)
        if not _finite(value) or value < 0:
            self.fail(f"{name} must be a number >= 0")
        return value

    def path(self, table: dict, key: str, name: str, required: bool) -> Path | None:
        value = table.get(key)
        if value is None:
            if required:
                self.fail(f"{name} is required")
            return None
        if not isinstance(value, str) or "\0" in value or not value.isprintable():
            self.fail(f"{name} must be a string naming a path")
        resolved = Path(value).expanduser()
        return resolved if resolved.is_absolute() else (self.file.parent / resolved).resolve()


def local_cluster_toml(
    split: Path,
    core_listen: str,
    workers: list[tuple[str, str, str]],
    gateway_host: str = "127.0.0.1",
    gateway_port: int = 8000,
) -> str:
    """The cluster.toml of a one-machine deployment (what `moe-mesh up` writes and starts from).
    workers: (name, address, experts)."""
    quote = json.dumps  # a JSON string is a valid TOML basic string
    lines = [
        "# Written by `moe-mesh up`: every service of this machine's cluster reads it.",
        "[model]",
        f"split = {quote(str(split))}",
        "",
        "[core]",
        f"listen = {quote(core_listen)}",
        "",
        "[gateway]",
        f"host = {quote(gateway_host)}",
        f"port = {int(gateway_port)}",
    ]
    for name, address, experts in workers:
        lines += ["", "[[workers]]", f"name = {quote(name)}", f"address = {quote(address)}"]
        lines += [f"experts = {quote(experts)}"]
    return "\n".join(lines) + "\n"
