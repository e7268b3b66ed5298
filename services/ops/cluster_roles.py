"""What each service takes from cluster.toml, with command-line flags overriding it.

`moe-mesh core|gateway|expert --config cluster.toml [--name WORKER]` fills every option
the user left at its default from the file. A flag given with a non-default value wins.
TLS (`[tls] dir` or `--tls-dir`) picks the service's own certificate by name: `core`,
`gateway`, or the worker's name.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from services.common.cli_types import port_number
from services.common.tls import TlsFiles
from services.core.expert_link.local_spec import LocalExpertsSpec
from services.ops.cluster import LOCAL_ADDRESS, ClusterConfig, load_cluster


def _unset(args: argparse.Namespace, dest: str) -> bool:
    """True when the user did not give the flag for `dest` (then cluster.toml may fill it)."""
    parser: argparse.ArgumentParser = args.parser
    argv = getattr(args, "argv", None)
    if argv is None:
        return getattr(args, dest) == parser.get_default(dest)
    options = [o for action in parser._actions if action.dest == dest for o in action.option_strings]
    return not any(token == o or token.startswith(o + "=") for token in argv for o in options)


def _fill(args: argparse.Namespace, dest: str, value) -> None:
    if value is not None and _unset(args, dest):
        setattr(args, dest, value)


def _metrics(args: argparse.Namespace, configured: str | None) -> str | None:
    if args.metrics_port:
        return f"{args.metrics_host}:{args.metrics_port}"
    return configured


def _tls(args: argparse.Namespace, config: ClusterConfig | None, name: str) -> TlsFiles | None:
    if args.tls_dir:
        return TlsFiles.in_dir(Path(args.tls_dir), name)
    return config.tls_for(name) if config is not None else None


def _config(args: argparse.Namespace) -> ClusterConfig | None:
    return load_cluster(args.config) if args.config else None


def _join_data_plane(args: argparse.Namespace, config: ClusterConfig, worker: str | None = None) -> None:
    """cluster.toml's [data_plane]: this service joins the group (unless --distributed says which
    backend), with its rank and [environment] in its own environment unless already set there."""
    if config.data_plane is None:
        return
    _fill(args, "distributed", config.data_plane)
    for name, value in config.data_plane_environment(worker).items():
        os.environ.setdefault(name, value)


def expert_kwargs(args: argparse.Namespace) -> dict:
    config = _config(args)
    worker = None
    if config is not None:
        if not args.name:
            names = ", ".join(w.name for w in config.workers)
            raise ValueError(f"--name is needed with --config: which worker is this? ({names})")
        worker = config.worker(args.name)
        if worker.is_local:
            raise ValueError(
                f"worker {worker.name!r} is local: core computes its experts, no process serves it"
            )
        _fill(args, "split", str(config.split))
        _fill(args, "listen", worker.listen)
        _fill(args, "layers", worker.layers)
        _fill(args, "experts", worker.experts)
        _fill(args, "worker_id", worker.worker_id or worker.name)
        if getattr(args, "memory_gb", None) is None and worker.memory_gb is not None:
            args.memory_gb = worker.memory_gb  # the streaming flags (experts/cli_flags.py) read it
        _join_data_plane(args, config, worker.name)
    if not args.split:
        raise ValueError("--split (or --config) is required")
    kwargs = {"memory_gb": args.memory_gb} if getattr(args, "memory_gb", None) is not None else {}
    return dict(
        **kwargs,
        split_dir=Path(args.split),
        listen=args.listen,
        layers=args.layers,
        experts=args.experts,
        worker_id=args.worker_id,
        tls=_tls(args, config, args.name or "expert"),
        insecure=args.insecure,
        metrics=_metrics(args, worker.metrics if worker else None),
    )


def core_kwargs(args: argparse.Namespace) -> dict:
    """Core's settings; a worker address `local` (flag or cluster.toml) becomes `local_experts`."""
    config = _config(args)
    workers = [w for spec in args.worker or [] for w in spec.split(",") if w]
    local = None
    if LOCAL_ADDRESS in workers:
        workers = [w for w in workers if w != LOCAL_ADDRESS]
        local = LocalExpertsSpec("all", args.local_memory_gb)
    elif config is not None and config.local_worker is not None and not args.worker:
        worker = config.local_worker
        local = LocalExpertsSpec(worker.layers, args.local_memory_gb or worker.memory_gb)
    if config is not None:
        _fill(args, "split", str(config.split))
        _fill(args, "listen", config.core.listen)
        _fill(args, "expert_timeout", config.core.expert_timeout_s)
        _fill(args, "max_num_seqs", config.core.max_num_seqs)
        _fill(args, "max_queue", config.core.max_queue)
        _fill(args, "max_num_batched_tokens", config.core.max_num_batched_tokens)
        _fill(args, "max_step_seconds", config.core.max_step_seconds)
        _fill(args, "micro_batches", config.core.micro_batches)
        _fill(args, "burst_gather_ms", config.core.burst_gather_ms)
        _fill(args, "prefix_cache_gb", config.core.prefix_cache_gb)
        _fill(args, "image_cache_gb", config.core.image_cache_gb)
        _fill(args, "mlx_cache_gb", config.core.mlx_cache_gb)
        _fill(args, "kv_cache", config.core.kv_cache)
        _fill(args, "speculative", config.core.speculative)
        _fill(args, "num_speculative_tokens", config.core.num_speculative_tokens)
        workers = workers or config.worker_addresses
        _join_data_plane(args, config)
    if not args.split:
        raise ValueError("--split (or --config) is required")
    if not workers and local is None:
        raise ValueError("--worker (or --config with [[workers]]) is required")
    return dict(
        split_dir=Path(args.split),
        listen=args.listen,
        workers=workers,
        local_experts=local,
        expert_timeout_s=args.expert_timeout,
        tls=_tls(args, config, "core"),
        insecure=args.insecure,
        metrics=_metrics(args, config.core.metrics if config else None),
    )


def gateway_kwargs(args: argparse.Namespace) -> dict:
    config = _config(args)
    if config is not None:
        _fill(args, "core", config.gateway_core_target)
        _fill(args, "host", config.gateway.host)
        _fill(args, "port", config.gateway.port)
    return dict(
        host=args.host,
        port=args.port,
        core_target=args.core,
        log_level=args.log_level,
        log_format=args.log_format,
        core_tls=_tls(args, config, "gateway"),
    )


def add_cluster_flags(
    parser: argparse.ArgumentParser, metrics: bool = True, serves_grpc: bool = True
) -> None:
    parser.add_argument("--config", default=None, help="cluster.toml (flags given here override it)")
    parser.add_argument(
        "--tls-dir", default=None, help="folder from `moe-mesh certs`: mTLS with this service's certificate"
    )
    if serves_grpc:
        parser.add_argument(
            "--insecure",
            action="store_true",
            help="listen beyond loopback without TLS (refused otherwise): anyone who reaches the port "
            "can drive the service, so only on a network you trust",
        )
    if metrics:
        parser.add_argument(
            "--metrics-port", type=port_number, default=None, help="serve Prometheus metrics on this port"
        )
        parser.add_argument("--metrics-host", default="127.0.0.1", help="address of the metrics endpoint")
