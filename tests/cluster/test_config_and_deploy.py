"""cluster.toml parsing and errors, flags over config, `cluster check` offline, rendered
launchd plists (parsed with plistlib) and systemd units (systemd-analyze verify where present)."""

from __future__ import annotations

import os
import plistlib
import shutil
import subprocess
from pathlib import Path

import pytest

from services.ops.cli import build_parser
from services.ops.cluster import ClusterConfigError, load_cluster
from services.ops.cluster_check import check_cluster
from services.ops.cluster_roles import core_kwargs, expert_kwargs, gateway_kwargs
from services.ops.deploy import render_launchd, render_systemd
from tests.cluster.conftest import write_cluster_toml

REPO = Path(__file__).resolve().parents[2]


def test_example_cluster_toml_parses():
    config = load_cluster(REPO / "deploy" / "cluster.toml")
    assert [w.name for w in config.workers] == ["mac-a", "mac-b"]
    assert config.worker("mac-b").experts == "56-127" and config.worker("mac-a").memory_gb == 56
    assert config.tls_for("mac-a").cert == REPO / "deploy" / "certs" / "mac-a.pem"
    assert config.gateway_core_target == "10.0.0.1:50051"


@pytest.mark.parametrize(
    "body, words",
    [
        ("[core]\n", "[model] is missing"),
        ('[model]\nsplit = "s"\n', "at least one [[workers]]"),
        ('[model]\nsplit = "s"\n[[workers]]\nname = "a"\n', "workers[0].address is required"),
        ('[model]\nsplit = "s"\nsplt = 1\n[[workers]]\naddress = "h:1"\n', "unknown key model.splt"),
        (
            '[model]\nsplit = "s"\n[core]\nexpert_timeout_s = -1\n[[workers]]\naddress = "h:1"\n',
            "core.expert_timeout_s",
        ),
        (
            '[model]\nsplit = "s"\n[[workers]]\nname = "a"\naddress = "h:1"\n[[workers]]\nname = "a"\naddress = "h:2"\n',
            "used twice",
        ),
        ("[model\n", "not valid TOML"),
        ('[model]\nsplit = "s"\n[gateway]\nport = 99999\n[[workers]]\naddress = "h:1"\n', "gateway.port"),
        ('[model]\nsplit = "s"\n[[workers]]\naddress = "nohostport"\n', "workers[0].address"),
        ('[model]\nsplit = "s"\n[[workers]]\naddress = "h:70000"\n', "a port is 1-65535"),
    ],
)
def test_bad_cluster_toml_is_one_clear_error(tmp_path, body, words):
    path = tmp_path / "cluster.toml"
    path.write_text(body)
    with pytest.raises(ClusterConfigError, match=None) as error:
        load_cluster(path)
    assert words in str(error.value) and str(path) in str(error.value)


def _config(tmp_path, split, workers, **kwargs):
    return write_cluster_toml(tmp_path / "cluster.toml", split, "127.0.0.1:50051", workers, **kwargs)


def test_flags_override_the_file_and_defaults_come_from_it(tmp_path, tiny_models):
    split = tiny_models.split("qwen3_moe", None)
    path = _config(
        tmp_path, split, [("a", "10.0.0.2:7000", "0-3"), ("b", "10.0.0.3:7000", "4-7")], tls_dir="certs"
    )
    parser = build_parser()
    args = parser.parse_args(["expert", "--config", str(path), "--name", "b", "--metrics-port", "9200"])
    kwargs = expert_kwargs(args)
    assert (kwargs["listen"], kwargs["experts"], kwargs["split_dir"]) == ("10.0.0.3:7000", "4-7", split)
    assert kwargs["metrics"] == "127.0.0.1:9200" and kwargs["tls"].cert == tmp_path / "certs" / "b.pem"
    args = parser.parse_args(["expert", "--config", str(path), "--name", "b", "--listen", "0.0.0.0:7000"])
    assert expert_kwargs(args)["listen"] == "0.0.0.0:7000"
    with pytest.raises(ValueError, match="--name is needed"):
        expert_kwargs(parser.parse_args(["expert", "--config", str(path)]))
    core = core_kwargs(parser.parse_args(["core", "--config", str(path)]))
    assert core["workers"] == ["10.0.0.2:7000", "10.0.0.3:7000"] and core["expert_timeout_s"] == 10
    assert core["tls"].cert.name == "core.pem"
    gateway = gateway_kwargs(parser.parse_args(["gateway", "--config", str(path), "--port", "9000"]))
    assert (gateway["core_target"], gateway["port"]) == ("127.0.0.1:50051", 9000)
    assert gateway["core_tls"].cert.name == "gateway.pem"


def test_cluster_check_finds_gaps_and_passes_a_covering_file(tmp_path, tiny_models):
    split = tiny_models.split("qwen3_moe", None)
    gap = check_cluster(
        load_cluster(_config(tmp_path, split, [("a", "10.0.0.2:1", "0-2"), ("b", "10.0.0.3:1", "4-7")])),
        probe=False,
    )
    assert not gap.ok
    assert gap.errors == [f"layer {layer} experts 3 have no owner" for layer in range(4)]

    covering = load_cluster(
        _config(tmp_path, split, [("a", "127.0.0.1:1", "0-4"), ("b", "127.0.0.1:2", "3-7")])
    )
    report = check_cluster(covering, probe=True, timeout_s=0.5)  # nobody listens: manifest only
    assert report.ok, report.lines()
    assert any("fewest replicas 1, most 2" in n for n in report.notes)
    assert any("not up" in n and "checked against the manifest only" in n for n in report.notes)
    shared = load_cluster(
        _config(tmp_path, split, [("a", "127.0.0.1:1", "0-4"), ("b", "127.0.0.1:1", "3-7")])
    )
    assert "workers a and b share the address 127.0.0.1:1" in check_cluster(shared, probe=False).errors
    assert any("single owner" in w for w in report.warnings)


def test_cluster_check_reports_fingerprint_and_budget(tmp_path, tiny_models):
    split = tiny_models.split("qwen3_moe", None)
    path = _config(tmp_path, split, [("a", "127.0.0.1:1", "all")])
    path.write_text(
        path.read_text().replace(f'split = "{split}"', f'split = "{split}"\nfingerprint = "deadbeef"')
        + "memory_gb = 0.00001\n"
    )
    report = check_cluster(load_cluster(path), probe=False)
    assert any("model.fingerprint deadbeef" in e for e in report.errors)
    assert any("stream from disk" in w for w in report.warnings)


def test_cluster_check_cli_exit_code(tmp_path, tiny_models, capsys):
    from services.ops.cli import main

    split = tiny_models.split("qwen3_moe", None)
    path = _config(tmp_path, split, [("a", "127.0.0.1:1", "0-6")])
    with pytest.raises(SystemExit) as exit_:
        main(["cluster", "check", "--config", str(path), "--offline"])
    assert exit_.value.code == 1
    assert "layer 0 experts 7 have no owner" in capsys.readouterr().out


ROLES = ["core", "gateway", "worker:mac-a", "worker:mac-b"]


@pytest.mark.parametrize("role", ROLES)
def test_launchd_plists_parse_and_keep_the_service_alive(role, tmp_path):
    config = load_cluster(REPO / "deploy" / "cluster.toml")
    rendered = render_launchd(config, role, tmp_path / "logs")
    plist = plistlib.loads(rendered.text.encode())
    assert plist["Label"] == rendered.filename.removesuffix(".plist")
    assert plist["RunAtLoad"] is True and plist["KeepAlive"] is True
    assert plist["ThrottleInterval"] > 0 and plist["ExitTimeOut"] >= 40  # room for the drain
    assert plist["StandardOutPath"].startswith(str(tmp_path / "logs"))
    assert plist["StandardErrorPath"].startswith(str(tmp_path / "logs"))
    assert plist["EnvironmentVariables"]["MOE_MESH_CACHE"] == "/Users/Shared/moe-mesh/cache"
    argv = plist["ProgramArguments"]
    assert Path(argv[0]).exists() and argv[1:4] == ["-P", "-m", "services.ops.cli"]
    args = build_parser().parse_args(argv[4:])  # the rendered command is one this CLI accepts
    assert args.config == str(config.path)
    if role.startswith("worker:"):
        assert args.command == "expert" and args.name == role.split(":")[1]


def test_unknown_role_is_refused():
    config = load_cluster(REPO / "deploy" / "cluster.toml")
    with pytest.raises(ValueError, match="worker:mac-a, worker:mac-b"):
        render_systemd(config, "worker")
    with pytest.raises(ClusterConfigError, match="no worker named 'mac-c'"):
        render_launchd(config, "worker:mac-c", Path("/tmp"))


def _verify_systemd_unit(rendered, folder: Path) -> None:
    """`systemd-analyze verify` finds nothing wrong with the unit (skips where it is missing)."""
    unit = folder / rendered.filename
    unit.write_text(rendered.text)
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed here; the unit text was checked above")
    done = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], check=False, capture_output=True, text=True, timeout=60
    )
    # verify also lints the host's own units; only lines about ours count.
    ours = [line for line in (done.stdout + done.stderr).splitlines() if rendered.filename in line]
    assert ours == [], ours


@pytest.mark.slow
@pytest.mark.parametrize("role", ROLES)
def test_systemd_units_verify(role, tmp_path):
    config = load_cluster(REPO / "deploy" / "cluster.toml")
    rendered = render_systemd(config, role)
    assert "Restart=always" in rendered.text and "KillSignal=SIGTERM" in rendered.text
    _verify_systemd_unit(rendered, tmp_path)


@pytest.mark.slow
def test_systemd_unit_keeps_paths_with_spaces_and_values_with_dollars_as_they_are(tmp_path):
    folder = tmp_path / "with space"
    folder.mkdir()
    text = (REPO / "deploy" / "cluster.toml").read_text()
    text = text.replace("\n[environment]", '\n[environment]\nMOE_MESH_CACHE = "/srv/a $HOME 50% \\"q\\""', 1)
    (folder / "cluster.toml").write_text(text)
    config = load_cluster(folder / "cluster.toml")
    rendered = render_systemd(config, "core")
    assert f"WorkingDirectory={folder}\n" in rendered.text
    assert 'Environment="MOE_MESH_CACHE=/srv/a $HOME 50%% \\"q\\""' in rendered.text
    assert 'ReadWritePaths="/srv/a $HOME 50%% \\"q\\""' in rendered.text
    _verify_systemd_unit(rendered, tmp_path)


def test_cluster_check_names_a_bad_expert_range(tmp_path, tiny_models):
    split = tiny_models.split("qwen3_moe", None)
    report = check_cluster(
        load_cluster(_config(tmp_path, split, [("a", "h:1", "0-7"), ("b", "h:2", "5-9")])), probe=False
    )
    assert report.errors == ["worker b: workers.b.experts: '5-9' is outside 0-7"]


def test_deploy_cli_writes_the_unit(tmp_path, capsys):
    from services.ops.cli import main

    main(
        [
            "deploy",
            "systemd",
            "--config",
            str(REPO / "deploy" / "cluster.toml"),
            "--role",
            "worker:mac-b",
            "--out",
            str(tmp_path),
        ]
    )
    unit = tmp_path / "moe-mesh-worker-mac-b.service"
    assert capsys.readouterr().out.strip() == str(unit)
    assert "--name mac-b" in unit.read_text()


def test_core_scheduling_and_kv_settings_come_from_the_file_unless_flagged(tmp_path, tiny_models):
    split = tiny_models.split("qwen3_moe", None)
    path = tmp_path / "cluster.toml"
    path.write_text(
        f'[model]\nsplit = "{split}"\n'
        '[core]\nmax_num_batched_tokens = 128\nmax_step_seconds = 0.5\nprefix_cache_gb = 0\nkv_cache = "turboquant"\n'
        "burst_gather_ms = 0\n"
        'speculative = "ngram"\nnum_speculative_tokens = 3\n'
        '[[workers]]\nname = "a"\naddress = "127.0.0.1:7000"\n'
    )
    parser = build_parser()
    args = parser.parse_args(["core", "--config", str(path)])
    core_kwargs(args)
    assert (args.max_num_batched_tokens, args.prefix_cache_gb, args.kv_cache) == (128, 0, "turboquant")
    assert args.max_step_seconds == 0.5 and args.burst_gather_ms == 0
    assert (args.speculative, args.num_speculative_tokens) == ("ngram", 3)
    args = parser.parse_args(
        ["core", "--config", str(path), "--max-num-batched-tokens", "64", "--kv-cache", "fp16"]
    )
    core_kwargs(args)
    assert (args.max_num_batched_tokens, args.kv_cache) == (64, "fp16")
    path.write_text(path.read_text().replace("prefix_cache_gb = 0", "prefix_cache_gb = -1"))
    with pytest.raises(ClusterConfigError, match="core.prefix_cache_gb"):
        load_cluster(path)


def test_a_local_worker_runs_inside_core(tmp_path, tiny_models):
    """`address = "local"`: core gets its layers and budget as local experts; it has no process
    of its own to start, deploy, certify or probe, and it serves whole layers only."""
    split = tiny_models.split("qwen3_moe", None)
    path = tmp_path / "cluster.toml"
    path.write_text(
        f'[model]\nsplit = "{split}"\n'
        '[[workers]]\nname = "here"\naddress = "local"\nlayers = "0-1"\nmemory_gb = 2\n'
        '[[workers]]\nname = "peer"\naddress = "127.0.0.1:7000"\nlayers = "2-3"\n'
    )
    config = load_cluster(path)
    assert config.local_worker.name == "here" and config.worker_addresses == ["127.0.0.1:7000"]
    parser = build_parser()
    core = core_kwargs(parser.parse_args(["core", "--config", str(path)]))
    assert core["workers"] == ["127.0.0.1:7000"]
    assert (core["local_experts"].layers, core["local_experts"].memory_gb) == ("0-1", 2)
    with pytest.raises(ValueError, match="is local"):
        expert_kwargs(parser.parse_args(["expert", "--config", str(path), "--name", "here"]))
    with pytest.raises(ValueError, match="is local"):
        render_systemd(config, "worker:here")
    report = check_cluster(config, probe=True, timeout_s=0.5)
    assert report.ok, report.lines()
    flagged = core_kwargs(
        parser.parse_args(["core", "--split", str(split), "--worker", "local", "--local-memory-gb", "1"])
    )
    assert flagged["workers"] == [] and flagged["local_experts"].memory_gb == 1

    path.write_text(path.read_text().replace('layers = "0-1"', 'layers = "0-1"\nexperts = "0-3"'))
    with pytest.raises(ClusterConfigError, match="whole layers"):
        load_cluster(path)


def test_data_plane_comes_from_the_file_with_each_service_rank(tmp_path, tiny_models, monkeypatch):
    """[data_plane] makes every service join one MLX group: core rank 0, the workers (not the
    local one) in file order, with [environment] (MLX's own variables) in each process."""
    for name in ("MLX_RANK", "MLX_WORLD_SIZE", "MLX_HOSTFILE"):
        monkeypatch.setenv(name, "")  # so that what the services set is undone after the test
        monkeypatch.delenv(name)
    split = tiny_models.split("qwen3_moe", None)
    path = tmp_path / "cluster.toml"
    path.write_text(
        f'[model]\nsplit = "{split}"\n[data_plane]\nbackend = "ring"\n'
        '[environment]\nMLX_HOSTFILE = "/etc/moe-mesh/hosts.json"\n'
        '[[workers]]\nname = "here"\naddress = "local"\nlayers = "0-1"\n'
        '[[workers]]\nname = "a"\naddress = "127.0.0.1:7000"\nlayers = "2"\n'
        '[[workers]]\nname = "b"\naddress = "127.0.0.1:7001"\nlayers = "3"\n'
    )
    config = load_cluster(path)
    assert config.data_plane == "ring"
    assert config.data_plane_environment("b") == {
        "MLX_HOSTFILE": "/etc/moe-mesh/hosts.json",
        "MLX_RANK": "2",
        "MLX_WORLD_SIZE": "3",
    }
    parser = build_parser()
    args = parser.parse_args(["expert", "--config", str(path), "--name", "a"])
    expert_kwargs(args)
    assert args.distributed == "ring" and os.environ["MLX_RANK"] == "1"
    monkeypatch.delenv("MLX_RANK")
    args = parser.parse_args(["core", "--config", str(path)])
    core_kwargs(args)
    assert args.distributed == "ring" and os.environ["MLX_RANK"] == "0"
    assert os.environ["MLX_HOSTFILE"] == "/etc/moe-mesh/hosts.json"
    path.write_text(path.read_text().replace('backend = "ring"', 'backend = "tcp"'))
    with pytest.raises(ClusterConfigError, match="data_plane.backend"):
        load_cluster(path)
