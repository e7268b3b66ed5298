"""`up`'s MPS daemon: when it is started, with which environment, and that it is stopped.

NVIDIA's control binary is replaced by a script on PATH that records how it was run: what it
does to a GPU is NVIDIA's; what moe-mesh relies on is being started once with the cluster's own
pipe folder, its clients getting that folder, and `quit` at the end.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from services.common.logging import configure_logging
from services.ops.gpu_sharing import CONTROL, mps_for_cluster
from services.ops.up import Cluster
from services.ops.up_console import LogRelay


@pytest.fixture(autouse=True)
def logs_to_this_test():
    """The daemon logs in this process: bind structlog to the stream pytest gives this test (an
    earlier test's configuration may hold a stream that has since been closed)."""
    configure_logging("test", "info", "json")


@pytest.fixture
def control(tmp_path, monkeypatch) -> Path:
    """A stand-in nvidia-cuda-mps-control; returns the file it records its runs in."""
    bin_dir, record = tmp_path / "bin", tmp_path / "runs.txt"
    bin_dir.mkdir()
    script = bin_dir / CONTROL
    script.write_text(
        "#!/bin/sh\n"
        f'echo "args=$* pipe=$CUDA_MPS_PIPE_DIRECTORY stdin=$(cat)" >> {record}\n'
        'test -d "$CUDA_MPS_PIPE_DIRECTORY"\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    return record


def test_auto_starts_a_private_daemon_when_processes_share_an_nvidia_gpu(control, tmp_path):
    daemon = mps_for_cluster("auto", tmp_path / "work", gpu_processes=3, gpus=1)
    assert daemon is not None
    daemon.start()
    pipe = tmp_path / "work" / "mps-pipe"
    assert daemon.env["CUDA_MPS_PIPE_DIRECTORY"] == str(pipe) and pipe.is_dir()
    daemon.stop()
    runs = control.read_text().splitlines()
    assert runs == [f"args=-d pipe={pipe} stdin=", f"args= pipe={pipe} stdin=quit"]


@pytest.mark.parametrize(
    ("gpu_processes", "gpus", "user_daemon"),
    [(1, 1, False), (3, 0, False), (3, 1, True)],
    ids=["core-alone", "no-nvidia-gpu", "user-runs-one"],
)
def test_auto_leaves_it_out_where_it_has_nothing_to_do(
    control, tmp_path, monkeypatch, gpu_processes, gpus, user_daemon
):
    if user_daemon:
        monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "theirs"))
    assert mps_for_cluster("auto", tmp_path, gpu_processes, gpus) is None
    assert mps_for_cluster("off", tmp_path, 3, 1) is None
    assert not control.exists()


def test_on_names_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no control binary
    with pytest.raises(ValueError, match=f"no NVIDIA GPU.*{CONTROL} is not on PATH"):
        mps_for_cluster("on", tmp_path, 3, 0)
    with pytest.raises(ValueError, match="--mps must be one of"):
        mps_for_cluster("yes", tmp_path, 3, 1)


def test_every_service_and_its_restart_run_as_a_client(tmp_path, monkeypatch):
    """Cluster.start gives each service the daemon's environment, restarts included."""
    seen = tmp_path / "seen.txt"
    command = [
        sys.executable,
        "-c",
        f"import os; open({str(seen)!r}, 'a').write(os.environ['CUDA_MPS_PIPE_DIRECTORY'] + '\\n')",
    ]
    monkeypatch.setattr("services.ops.up.cli_command", lambda *args: command)
    relay = LogRelay(as_json=True)
    cluster = Cluster(tmp_path, "info", tmp_path, relay)
    cluster.base_env = {"CUDA_MPS_PIPE_DIRECTORY": "/tmp/pipe-of-this-cluster"}
    cluster.start("expert-0", "expert")
    cluster.procs[0][1].wait(timeout=30)
    assert cluster.restart("expert-0")
    cluster.procs[0][1].wait(timeout=30)
    relay.stop()
    assert seen.read_text().splitlines() == ["/tmp/pipe-of-this-cluster"] * 2


@pytest.mark.parametrize("required", [False, True], ids=["auto", "on"])
def test_a_daemon_whose_client_fails_is_stopped_and_left_out(control, tmp_path, monkeypatch, required):
    """A GPU that refuses MPS fails the daemon's clients: `up` finds out with a probe before any
    service starts, stops the daemon, and serves without it (auto) or says why it cannot (on)."""
    from services.ops.up import _start_mps

    monkeypatch.setattr(
        "services.ops.gpu_sharing.CLIENT_PROBE",
        (sys.executable, "-c", "import sys; sys.exit('MPS client failed to connect')"),
    )
    daemon = mps_for_cluster("on" if required else "auto", tmp_path, gpu_processes=2, gpus=1)
    if required:
        with pytest.raises(SystemExit, match="--mps on: MPS client failed to connect"):
            _start_mps(daemon, required=True)
    else:
        assert _start_mps(daemon, required=False) == "MPS client failed to connect"
    assert not daemon.started
    assert [run.split(" pipe=")[0] for run in control.read_text().splitlines()] == ["args=-d", "args="]


def test_a_working_client_keeps_the_daemon(control, tmp_path):
    from services.ops.up import _start_mps

    daemon = mps_for_cluster("auto", tmp_path, gpu_processes=2, gpus=1)
    assert _start_mps(daemon, required=False) is None  # the real probe, MLX on this machine
    assert daemon.started
    daemon.stop()
