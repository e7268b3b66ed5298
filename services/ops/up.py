"""`moe-mesh up`: the whole system on this machine, one command.

Starts N expert workers (experts divided between them), the core and the gateway
as child processes linked by Unix sockets; waits until each is healthy; prints the
URL; on Ctrl-C or SIGTERM stops them all (SIGTERM, then SIGKILL after a grace
period) and removes the sockets. On Linux the children also die with this process
(PR_SET_PDEATHSIG), so even a SIGKILL of `up` leaves no orphans. A worker that dies while serving
is started again (at most 5 times a minute), as a service manager would; core or the gateway
dying stops everything.
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess  # nosec B404
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from services.common.frames import frames_path_for
from services.common.logging import get_logger, renders_console
from services.common.ranges import format_ranges
from services.ops.cluster import LOCAL_ADDRESS, local_cluster_toml
from services.ops.command import cli_command
from services.ops.gpu_sharing import MpsDaemon, mps_for_cluster
from services.ops.up_console import LogRelay, new_log_dir

log = get_logger(__name__)
READY_TIMEOUT_S = 600.0
RESTART_LIMIT = 5  # a worker that dies this often ...
RESTART_WINDOW_S = 60.0  # ... within this many seconds stops `up`


def cache_root() -> Path:
    return Path(os.environ.get("MOE_MESH_CACHE", Path.home() / ".cache" / "moe-mesh"))


def resolve_split(model: str | None) -> Path:
    """A split folder for `model` (a split, a checkpoint folder or Hugging Face repo id, or None = the
    demo model), splitting once."""
    from services.common.model_source import resolve_model
    from services.tools.split import split_checkpoint

    if model is None:
        from services.tools.demo_model import ensure_demo_model

        source = ensure_demo_model()
    else:
        source = resolve_model(model)
        if (source / "manifest.json").exists():
            return source
    # the cached split is the checkpoint's as long as its config and weight files are unchanged
    stamps = [
        f"{path.name}:{path.stat().st_size}:{path.stat().st_mtime_ns}"
        for path in sorted([source / "config.json", *source.glob("*.safetensors")])
    ]
    key = hashlib.sha256(":".join([str(source), *stamps]).encode()).hexdigest()[:12]
    split_dir = cache_root() / "splits" / f"{source.name}-{key}"
    split_dir.parent.mkdir(parents=True, exist_ok=True)
    # two `up`s of one checkpoint at once: the second waits for the first's split, then uses it
    with open(split_dir.parent / f".{split_dir.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another moe-mesh to finish splitting {source}", file=sys.stderr)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if not (split_dir / "manifest.json").exists():
            from services.tools.split_disk import GB, split_bytes

            needs = split_bytes(source) / GB
            print(f"splitting {source} into {split_dir} (once, {needs:.2f} GB)", file=sys.stderr)
            split_checkpoint(source, split_dir)
    return split_dir


def expert_ranges(num_experts: int, workers: int, replicas: int = 1) -> list[str]:
    """Each worker's experts: the experts cut into `workers` blocks; worker i holds block i and,
    with `replicas` > 1, the next replicas - 1 blocks (wrapping), so every expert lives on
    `replicas` workers and losing any replicas - 1 of them loses none."""
    if not 1 <= workers <= num_experts:
        raise SystemExit(
            f"moe-mesh up: --experts must be between 1 and {num_experts} (the model's experts per layer)"
        )
    if not 1 <= replicas <= workers:
        raise SystemExit(f"moe-mesh up: --replicas must be between 1 and --experts ({workers})")
    bounds = [round(i * num_experts / workers) for i in range(workers + 1)]
    blocks = [list(range(bounds[i], bounds[i + 1])) for i in range(workers)]
    return [
        format_ranges([e for j in range(replicas) for e in blocks[(i + j) % workers]]) for i in range(workers)
    ]


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Cluster:
    def __init__(self, workdir: Path, log_level: str, logs: Path, relay: LogRelay):
        """`workdir`: sockets and cluster.toml; `logs`: each service's log, which `relay` follows."""
        self.workdir = workdir
        self.logs = logs
        self.log_level = log_level
        self.relay = relay
        self.procs: list[tuple[str, subprocess.Popen, Path]] = []
        self._args: dict[str, tuple[str, ...]] = {}
        self._env: dict[str, dict[str, str] | None] = {}
        self._restarts: dict[str, list[float]] = {}
        self.base_env: dict[str, str] = {}  # given to every service, restarts included (MPS)

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> None:
        """Start service `name` (`env`: variables added to this process's environment)."""
        log_path = self.logs / f"{name}.log"
        self.relay.follow(name, log_path)
        command = cli_command("--log-level", self.log_level, "--log-format", "json", *args)
        with open(log_path, "ab") as log_file:
            # our own CLI (sys.executable -m services.ops.cli) with our flags, no shell
            proc = subprocess.Popen(  # nosec B603
                command,
                env={**os.environ, **self.base_env, **(env or {})} if env or self.base_env else None,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                # Their own session: a Ctrl-C in the terminal reaches `up` alone, which then stops
                # each child once, in order (not every child twice).
                start_new_session=True,
                preexec_fn=_die_with_parent,  # noqa: PLW1509 - only calls prctl, no locks taken
            )
        self._args[name] = args
        self._env[name] = env
        names = [entry[0] for entry in self.procs]
        if name in names:  # a restart keeps its place: stop() goes gateway, core, workers
            self.procs[names.index(name)] = (name, proc, log_path)
        else:
            self.procs.append((name, proc, log_path))

    def dead(self) -> tuple[str, int, Path] | None:
        for name, proc, log_path in self.procs:
            if proc.poll() is not None:
                return name, proc.returncode, log_path
        return None

    def restart(self, name: str) -> bool:
        """Start `name` again, unless it has died RESTART_LIMIT times within RESTART_WINDOW_S (a
        worker that cannot stay up: restarting it for ever would hide why)."""
        now = time.monotonic()
        recent = [t for t in self._restarts.get(name, []) if now - t < RESTART_WINDOW_S]
        if len(recent) >= RESTART_LIMIT:
            return False
        self._restarts[name] = [*recent, now]
        # Without its data plane environment: a group cannot take a member back, so a restarted
        # worker serves gRPC alone (services/core/expert_link/distributed.py).
        self.start(name, *self._args[name])
        return True

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop the services a role at a time, the gateway, then core, then the workers, each role
        gone before the next is signalled: core finishes its requests while the workers they need
        still serve them, and sees no worker leave. What is left at `grace_s` is killed."""
        deadline = time.monotonic() + grace_s
        roles = itertools.groupby(reversed(self.procs), key=lambda entry: entry[0].rsplit("-", 1)[0])
        for _, entries in roles:
            procs = [proc for _, proc, _ in entries]
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in procs:
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def worker_compute_threads(experts: int) -> int:
    """CPU-kernel threads for each of `experts` workers beside a core on this machine: an equal
    share of the cores, core counted as one (while it waits for a layer it may poll a core busy;
    a worker's extra threads competing with it cost more than they gain)."""
    from metal.experts_cpu import default_threads

    return max(1, default_threads() // (experts + 1))


def _check_port_free(host: str, port: int) -> None:
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds it
            probe.bind((host, port))
    except OSError as error:
        raise SystemExit(f"moe-mesh up: cannot serve on {host}:{port}: {error.strerror or error}") from None


def _grpc_serving(address: str) -> bool:
    import asyncio

    from services.common.grpc_util import check_health

    return asyncio.run(check_health(address, timeout_s=1.0))


def _gateway_ready(url: str) -> bool:
    """The gateway answers and reaches a SERVING core over its own channel."""
    try:
        # url is http://127.0.0.1:PORT/health, made by up itself
        with urllib.request.urlopen(url, timeout=1.0) as reply:  # nosec B310
            return reply.status == 200 and json.load(reply).get("core") == "SERVING"
    except (OSError, ValueError):
        return False


def run_up(
    model: str | None,
    experts: int,
    port: int,
    host: str = "127.0.0.1",
    workdir: str | None = None,
    gateway_args: Sequence[str] = (),
    expert_memory_gb: float | None = None,
    core_args: Sequence[str] = (),
    frame_spin_us: int | None = None,
    log_level: str = "info",
    local_experts: bool = False,
    distributed: str | None = None,
    model_name: str | None = None,
    log_format: str = "auto",
    replicas: int = 1,
    mlx_cache_gb: float | None = None,
    mps: str = "auto",
) -> int:
    """`frame_spin_us`: how long core's and the workers' frame reads poll (None: poll when the
    machine has a core for each of them, services.common.frames.spin_for); `local_experts`: no
    worker processes, core computes every expert itself (services/core/expert_link/local.py);
    `distributed`: core and the workers form an in-graph data plane on this backend; `model_name`:
    the name core serves the model under (core_args carry it), for the ready line; `replicas`:
    workers holding each expert (expert_ranges); `mlx_cache_gb`: the workers' MLX buffer-cache
    limit (core's comes with core_args); `mps`: NVIDIA's MPS daemon for the services (auto, on,
    off: services/ops/gpu_sharing.py). Logs go to `workdir`, else to a new folder under
    $MOE_MESH_CACHE/logs that stays after the run."""
    from services.common.frames import spin_for
    from services.common.manifest import Manifest

    _check_port_free(host, port)  # before minutes of model loading, not after
    own_workdir = workdir is None
    if workdir is not None:
        work = Path(workdir)
        work.mkdir(parents=True, exist_ok=True)
        # One `up` per workdir, held while it runs: a second one would rewrite cluster.toml and,
        # on its way out, remove the sockets of the first.
        workdir_lock = open(work / ".up.lock", "w")  # held (and locked) until this process exits
        try:
            fcntl.flock(workdir_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SystemExit(
                f"moe-mesh up: another moe-mesh up is running in {work}; give another --workdir"
            ) from None
    split_dir = resolve_split(model)
    manifest = Manifest.load(split_dir)
    if local_experts:
        experts = 0
    ranges = expert_ranges(manifest.num_experts, experts, replicas) if experts else []
    if workdir is None:
        work = Path(tempfile.mkdtemp(prefix="moe-mesh-"))  # sockets: a short path, removed at exit
        logs = new_log_dir(cache_root() / "logs")
    else:
        logs = work
    relay = LogRelay(as_json=not renders_console(log_format))
    relay.start()
    cluster = Cluster(work, log_level, logs, relay)
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    worker_sockets = [f"unix:{work / f'expert-{i}.sock'}" for i in range(experts)]
    core_socket = f"unix:{work / 'core.sock'}"
    # One cluster.toml for the whole machine; each service starts from it plus its role.
    config = work / "cluster.toml"
    config.write_text(
        local_cluster_toml(
            split_dir,
            core_socket,
            [(f"expert-{i}", a, span) for i, (a, span) in enumerate(zip(worker_sockets, ranges, strict=True))]
            or [("local", LOCAL_ADDRESS, "all")],
            host,
            port,
        )
    )
    if frame_spin_us is None:
        frame_spin_us = round(spin_for(experts + 1) * 1e6)
    spin = ["--frame-spin-us", str(frame_spin_us)]
    threads = ["--compute-threads", str(worker_compute_threads(experts))]
    plane_envs = data_plane_envs(work, distributed, experts + 1) if distributed and experts else None
    plane = ["--distributed", distributed] if plane_envs else []
    daemon = None
    try:
        daemon = mps_for_cluster(mps, work, experts + 1, gpu_count() if mps != "off" else 0)
        if daemon is not None:
            if (problem := _start_mps(daemon, required=mps == "on")) is not None:
                print(f"moe-mesh up: serving without MPS ({problem})", file=sys.stderr)
            cluster.base_env = daemon.env if daemon.started else {}
        for i in range(experts):
            # Each worker keeps at most expert_memory_gb of its experts in RAM, streams the rest.
            budget = ["--memory-gb", str(expert_memory_gb)] if expert_memory_gb else []
            if mlx_cache_gb is not None:
                budget += ["--mlx-cache-gb", str(mlx_cache_gb)]
            cluster.start(
                f"expert-{i}",
                "expert",
                "--config",
                str(config),
                "--name",
                f"expert-{i}",
                *budget,
                *spin,
                *threads,
                *plane,
                env=plane_envs[i + 1] if plane_envs else None,
            )
        local_budget = (
            ["--local-memory-gb", str(expert_memory_gb)] if expert_memory_gb and local_experts else []
        )
        cluster.start(
            "core",
            "core",
            "--config",
            str(config),
            # stop() takes the gateway down before core: nothing is left to watch core drain
            "--drain-s",
            "0",
            *core_args,
            *local_budget,
            *spin,
            *plane,
            env=plane_envs[0] if plane_envs else None,
        )
        cluster.start("gateway", "gateway", "--config", str(config), *gateway_args)
        url = f"http://{host}:{port}"
        checks = [(address, lambda a=address: _grpc_serving(a)) for address in worker_sockets]
        checks += [
            ("core", lambda: _grpc_serving(core_socket)),
            ("gateway", lambda: _gateway_ready(f"{url}/health")),
        ]
        deadline = time.monotonic() + READY_TIMEOUT_S
        pending = list(checks)
        starting = f"{experts} expert workers, core" if experts else "core (with every expert in it)"
        print(f"starting {starting} and gateway (logs in {logs})", file=sys.stderr)
        while pending and not stopping:
            if (dead := cluster.dead()) is not None:
                return _report_death(*dead)
            if time.monotonic() > deadline:
                print(
                    f"moe-mesh up: not ready after {READY_TIMEOUT_S:.0f} s: {[name for name, _ in pending]}",
                    file=sys.stderr,
                )
                return 1
            pending = [(name, check) for name, check in pending if not check()]
            time.sleep(0.2)
        if not stopping:
            model = f"{model_name or manifest.model_id(split_dir)} ({manifest.model_type})"
            print(f"moe-mesh is serving {model} at {url}/v1  (Ctrl-C stops it)", flush=True)
        while not stopping:
            if (dead := cluster.dead()) is not None:
                name, code, log_path = dead
                # A worker or core that dies is started again, as launchd/systemd would. A worker:
                # core fails the requests of that step, reports NOT_SERVING, and serves again once
                # it is back. Core (killed, or its data plane left a step blocked: exit code
                # services/common/data_plane_flag.DATA_PLANE_STUCK): the gateway answers 503
                # meanwhile and reconnects by itself.
                if name == "gateway" or not cluster.restart(name):
                    return _report_death(*dead)
                print(f"moe-mesh up: {name} exited with code {code}; started it again", file=sys.stderr)
            time.sleep(0.5)
        return 0
    finally:
        print("stopping moe-mesh", file=sys.stderr)
        cluster.stop()
        if daemon is not None and daemon.started:
            daemon.stop()
        relay.stop()
        for address in [*worker_sockets, core_socket]:
            Path(address.removeprefix("unix:")).unlink(missing_ok=True)
        for address in worker_sockets:  # a worker that died left its frame socket behind
            Path(frames_path_for(address.removeprefix("unix:"))).unlink(missing_ok=True)
        if own_workdir:  # sockets and cluster.toml only: the logs are elsewhere and stay
            shutil.rmtree(work, ignore_errors=True)
        print(f"logs are in {logs}", file=sys.stderr)


def data_plane_envs(work: Path, backend: str, members: int) -> list[dict[str, str]]:
    """Each member's environment for MLX's group on this host, as `mlx.launch` would set it:
    core is rank 0, worker i rank i + 1. Ring gets a hostfile of loopback ports; NCCL puts rank r
    on GPU r (modulo the GPUs there are: several ranks on one GPU do not work in NCCL)."""
    hostfile = work / "data-plane-hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(members)]))
    common = {"MLX_HOSTFILE": str(hostfile), "MLX_WORLD_SIZE": str(members)}
    if backend == "nccl":
        common.update(NCCL_HOST_IP="127.0.0.1", NCCL_PORT=str(free_port()))
    envs = [{**common, "MLX_RANK": str(rank)} for rank in range(members)]
    if backend == "nccl":
        gpus = max(1, gpu_count())
        for rank, env in enumerate(envs):
            env["CUDA_VISIBLE_DEVICES"] = str(rank % gpus)
    return envs


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def gpu_count() -> int:
    """NVIDIA GPUs this host has (0 where nvidia-smi is absent)."""
    try:
        # found on PATH as the NVIDIA driver installs it; fixed arguments, no shell
        listing = subprocess.run(  # nosec B603 B607
            ["nvidia-smi", "-L"], check=False, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in listing.stdout.splitlines())


def _start_mps(daemon: MpsDaemon, required: bool) -> str | None:
    """Start the daemon and check that a client works; with `auto` a daemon that fails either is
    stopped and left out, and what went wrong is returned (the services run without it)."""
    try:
        daemon.start()
        problem = daemon.client_problem()
    except (OSError, subprocess.SubprocessError) as error:
        problem = f"its daemon did not start: {error}"
    if problem is None:
        return None
    if daemon.started:
        daemon.stop()
    if required:
        raise SystemExit(f"moe-mesh up: --mps on: {problem}")
    return problem


def _report_death(name: str, code: int, log_path: Path) -> int:
    tail = log_path.read_text(errors="replace").splitlines()[-15:] if log_path.exists() else []
    print(f"moe-mesh up: {name} exited with code {code}; last lines of {log_path}:", file=sys.stderr)
    for line in tail:
        print("  " + line, file=sys.stderr)
    return 1
