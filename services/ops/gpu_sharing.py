"""One NVIDIA MPS control daemon for the processes `moe-mesh up` starts on one host.

Core and a same-host worker take turns on the GPU at every layer call. Without MPS each process
has its own CUDA context and every turn is a context switch; under MPS their work goes through
one server and the switch goes away (docs/benchmarks.md, `bench/gpu_turns.py`). `up` therefore
starts a daemon of its own, with its pipe and log folders in the cluster's workdir (no root
needed, no system daemon touched), and gives every service the environment that makes it a
client. Apple GPUs and CPUs have nothing of the kind to do.
"""

from __future__ import annotations

import os
import shutil
import subprocess  # nosec B404 - runs NVIDIA's control binary and this interpreter, fixed arguments
import sys
from pathlib import Path

from services.common.logging import get_logger

log = get_logger(__name__)

CONTROL = "nvidia-cuda-mps-control"
MPS_SETTINGS = ("auto", "on", "off")
# What a client of the daemon must be able to do: MLX computing one array on the default device.
CLIENT_PROBE = (sys.executable, "-c", "import mlx.core as mx; mx.eval(mx.ones(4) + 1)")


class MpsDaemon:
    """An MPS control daemon whose clients are the processes started with `env`."""

    def __init__(self, control: str, workdir: Path):
        self.control = control
        self.started = False
        self.env = {
            "CUDA_MPS_PIPE_DIRECTORY": str(workdir / "mps-pipe"),
            "CUDA_MPS_LOG_DIRECTORY": str(workdir / "mps-log"),
        }

    def start(self) -> None:
        for folder in self.env.values():
            Path(folder).mkdir(parents=True, exist_ok=True)
        self._run("-d")
        self.started = True
        log.info("mps_daemon_started", pipe=self.env["CUDA_MPS_PIPE_DIRECTORY"])

    def client_problem(self) -> str | None:
        """Run CLIENT_PROBE as a client of the daemon: None when it works, else what went wrong (a
        GPU that refuses MPS fails its clients, and the services must not be the first to find out)."""
        try:
            done = subprocess.run(  # nosec B603 - this interpreter, fixed code
                CLIENT_PROBE,
                check=False,
                env={**os.environ, **self.env},
                capture_output=True,
                text=True,
                timeout=120,
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            return str(error)
        if done.returncode != 0:
            return (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        return None

    def stop(self) -> None:
        """Ask the daemon to quit (it waits for its clients, which `up` has stopped by then)."""
        self.started = False
        try:
            self._run(stdin="quit\n")
        except (OSError, subprocess.SubprocessError) as error:
            log.warning("mps_daemon_stop_failed", error=str(error))

    def _run(self, *args: str, stdin: str | None = None) -> None:
        subprocess.run(  # nosec B603 - NVIDIA's control binary, found on PATH; no shell
            [self.control, *args],
            input=stdin,
            text=True,
            env={**os.environ, **self.env},
            check=True,
            capture_output=True,
            timeout=30,
        )


def mps_for_cluster(setting: str, workdir: Path, gpu_processes: int, gpus: int) -> MpsDaemon | None:
    """The daemon `up` should start, or None. `auto`: where NVIDIA GPUs and the control binary are
    there, more than one process of the cluster computes on them, and the user has not pointed
    its clients at a daemon of their own (CUDA_MPS_PIPE_DIRECTORY). `on` insists (an error
    naming what is missing); `off` never."""
    if setting not in MPS_SETTINGS:
        raise ValueError(f"--mps must be one of {', '.join(MPS_SETTINGS)}, not {setting!r}")
    if setting == "off":
        return None
    control = shutil.which(CONTROL)
    missing = []
    if gpus == 0:
        missing.append("no NVIDIA GPU (nvidia-smi lists none)")
    if control is None:
        missing.append(f"{CONTROL} is not on PATH")
    if setting == "on" and missing:
        raise ValueError(f"--mps on: {'; '.join(missing)}")
    if missing or (setting == "auto" and (gpu_processes < 2 or "CUDA_MPS_PIPE_DIRECTORY" in os.environ)):
        return None
    return MpsDaemon(control, workdir)
