"""Shared test helpers: tiny checkpoints, real worker/core processes, health waits."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_util import normalize_address
from services.ops.up import free_port  # noqa: F401 - the tests take it from here
from services.proto.moemesh.v1 import core_pb2, core_pb2_grpc, expert_pb2

REPO = Path(__file__).resolve().parents[1]


def fake_link(layers: list[int], experts: list[int], up: bool = True) -> SimpleNamespace:
    """What ExpertDispatcher keeps of a worker link, for routing tests without sockets."""
    describe = expert_pb2.DescribeResponse()
    for layer in layers:
        describe.layers.add(layer=layer, experts=experts)
    return SimpleNamespace(
        up=up,
        describe=describe,
        last_describe=describe,
        last_error="",
        address=f"unix:/w{len(experts)}-{experts[0] if experts else 0}.sock",
        reconnecting=None,
    )


_SHORT_DIRS: list[Path] = []


def short_dir(prefix: str = "mm-") -> Path:
    """A new folder under /tmp, short enough for Unix socket paths (~107 bytes at most);
    removed when the test session ends (tests/conftest.py), so runs leave nothing behind."""
    import tempfile

    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    _SHORT_DIRS.append(path)
    return path


def remove_short_dirs() -> None:
    import shutil

    while _SHORT_DIRS:
        shutil.rmtree(_SHORT_DIRS.pop(), ignore_errors=True)


def spawn(args: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`moe-mesh ARGS` with its output in `log_path` (`env`: variables added to this environment)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "services.ops.cli", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=env,
        )


def core_args(split: Path, listen: str, workers: list[str], *extra: str) -> list[str]:
    """`moe-mesh core` arguments for a core over `workers` (for `spawn`)."""
    return ["core", "--split", str(split), "--listen", listen, "--worker", ",".join(workers), *extra]


async def health_status(channel: grpc.aio.Channel) -> int:
    """The gRPC health status a server reports on `channel`, or -1 when it does not answer."""
    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
    except grpc.aio.AioRpcError:
        return -1
    return reply.status


def serving(address: str) -> bool:
    """Sync health check (usable from async tests, unlike asyncio.run)."""
    with grpc.insecure_channel(normalize_address(address)) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def wait_serving(
    address: str, proc: subprocess.Popen | None = None, timeout_s: float = 120.0, log_path: Path | None = None
):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(
                f"process exited with {proc.returncode}: {log_path.read_text()[-3000:] if log_path else ''}"
            )
        if serving(address):
            return
        time.sleep(0.1)
    raise TimeoutError(
        f"{address} not SERVING after {timeout_s} s: {log_path.read_text()[-3000:] if log_path else ''}"
    )


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Workers:
    """Expert worker processes on Unix sockets, one per expert range."""

    def __init__(
        self,
        split_dir: Path,
        workdir: Path,
        ranges: list[str],
        tag: str = "w",
        extra_args: tuple = (),
        envs: list[dict[str, str]] | None = None,
    ):
        """`envs`: each worker's added environment (a data plane rank, say)."""
        self.split_dir, self.workdir, self.ranges, self.tag = split_dir, workdir, ranges, tag
        self.extra_args = list(extra_args)
        self.envs = envs or [{} for _ in ranges]
        self.addresses = [f"unix:{workdir / f'{tag}{i}.sock'}" for i in range(len(ranges))]
        self.logs = [workdir / f"{tag}{i}.log" for i in range(len(ranges))]
        self.procs: list[subprocess.Popen | None] = [None] * len(ranges)

    def start(self, index: int | None = None) -> Workers:
        indices = range(len(self.ranges)) if index is None else [index]
        for i in indices:
            self.procs[i] = spawn(
                [
                    "expert",
                    "--split",
                    str(self.split_dir),
                    "--listen",
                    self.addresses[i],
                    "--experts",
                    self.ranges[i],
                    *self.extra_args,
                ],
                self.logs[i],
                self.envs[i],
            )
        for i in indices:
            wait_serving(self.addresses[i], self.procs[i], log_path=self.logs[i])
        return self

    def ensure_running(self) -> Workers:
        for i, proc in enumerate(self.procs):
            if proc is None or proc.poll() is not None:
                self.start(i)
        return self

    def kill(self, index: int) -> None:
        self.procs[index].kill()
        self.procs[index].wait()

    def stop(self) -> None:
        stop([p for p in self.procs if p is not None])


@contextlib.contextmanager
def linked_dispatcher(
    split_dir: Path, workdir: Path, ranges: list[str], tag: str = "w", worker_args: tuple = (), **kwargs
):
    """Worker processes for `ranges` (started with `worker_args`) plus a core-side
    ExpertDispatcher(**kwargs) that reaches all of them.

    Yields (workers, dispatcher, manifest); stops everything on exit.
    """
    from services.common.manifest import Manifest
    from services.core.expert_link.dispatcher import ExpertDispatcher

    manifest = Manifest.load(split_dir)
    workers = Workers(split_dir, workdir, ranges, tag=tag, extra_args=worker_args).start()
    dispatcher = None
    try:
        dispatcher = ExpertDispatcher(manifest, workers.addresses, **kwargs)
        problems = dispatcher.discover()
        assert problems == [], problems
        yield workers, dispatcher, manifest
    finally:
        if dispatcher is not None:
            dispatcher.close()
        workers.stop()


def run_cli(
    *args: str, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`moe-mesh ARGS` to completion, output captured (`env`: the whole environment; None: this one)."""
    return subprocess.run(
        [sys.executable, "-m", "services.ops.cli", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def place_in_hf_cache(hf_home: Path, repo_id: str, checkpoint: Path) -> Path:
    """Copy `checkpoint` into a Hugging Face cache under `hf_home` as `repo_id` (main -> one
    commit), the layout `huggingface_hub` reads offline; returns the snapshot folder."""
    import shutil

    repo = Path(hf_home) / "hub" / f"models--{repo_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(checkpoint, snapshot)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


async def greedy_ids(stub: core_pb2_grpc.CoreStub, prompt: list[int], max_tokens: int) -> list[int]:
    """Core's greedy continuation of token ids `prompt`: exactly `max_tokens` token ids."""
    request = core_pb2.GenerateRequest(
        token_ids=core_pb2.TokenIds(ids=prompt),
        sampling=core_pb2.SamplingParams(temperature=0),
        stopping=core_pb2.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
    )
    return [t async for chunk in stub.Generate(request, timeout=120) for t in chunk.token_ids]
