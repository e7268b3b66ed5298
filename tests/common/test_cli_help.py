"""The command line a user reads: every `--help` names each flag's default, and `up` passes core's
serving flags through to the core it starts."""

from __future__ import annotations

import argparse

import pytest

from services.ops import cli


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _commands(child, (*path, name))


def test_every_help_names_every_default():
    missing = []
    for path, parser in _commands(cli.build_parser()):
        text = " ".join(parser.format_help().split())  # wrapping may split "(default: x)"
        for action in parser._actions:
            if not action.option_strings or action.help == argparse.SUPPRESS:
                continue
            if action.default in (None, False, argparse.SUPPRESS):
                continue
            if f"default: {action.default}" not in text and "default" not in (action.help or ""):
                missing.append(f"moe-mesh {' '.join(path)} {action.option_strings[0]}")
    assert not missing, missing


def test_up_passes_serving_flags_to_core(monkeypatch):
    import services.ops.up

    seen = {}

    def fake_run_up(**kwargs):
        seen.update(kwargs)
        return 0

    monkeypatch.setattr(services.ops.up, "run_up", fake_run_up)
    argv = ["up", "--max-num-seqs", "4", "--max-num-batched-tokens", "128", "--prefix-cache-gb", "0"]
    with pytest.raises(SystemExit) as exit_:
        cli.main([*argv, "--max-queue", "9", "--kv-cache", "turboquant", "--max-model-len", "128"])
    assert exit_.value.code == 0
    core_args = seen["core_args"]
    pairs = {
        flag: value for flag, value in zip(core_args, core_args[1:], strict=False) if flag.startswith("--")
    }
    assert pairs["--max-num-seqs"] == "4" and pairs["--max-num-batched-tokens"] == "128"
    assert pairs["--prefix-cache-gb"] == "0.0" and pairs["--max-queue"] == "9"
    assert pairs["--kv-cache"] == "turboquant" and pairs["--max-model-len"] == "128"
    # and core's own parser takes them as they are
    parsed = cli.build_parser().parse_args(["core", "--split", "s", "--worker", "local", *core_args])
    assert (parsed.max_num_seqs, parsed.max_queue, parsed.prefix_cache_gb) == (4, 9, 0.0)


@pytest.mark.slow
def test_service_files_naming_the_old_module_still_start():
    """launchd/systemd files rendered before the command line moved run `python -m services.cli`."""
    import subprocess
    import sys

    from services.ops.command import cli_command

    def version(module: str) -> str:
        command = [sys.executable, "-m", module, "--version"]
        return subprocess.run(command, check=True, capture_output=True, text=True, timeout=60).stdout

    assert cli_command("core")[-2:] == ["services.ops.cli", "core"]
    assert version("services.cli") == version("services.ops.cli") and "moe-mesh" in version("services.cli")
