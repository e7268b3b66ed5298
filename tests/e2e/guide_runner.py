"""Run a guide in `docs/` command by command, the way a reader would, on one machine.

A guide is Markdown; its fenced `bash` blocks are run in order with bash (`-e -o pipefail`), its
fenced files are written where the guide says. An HTML comment on the line before a block directs
the run (readers never see it):

- `<!-- guide-test: skip (why) -->`      not run (the README's install, which CI runs itself);
- `<!-- guide-test: file PATH -->`       the block is a file the reader saves at PATH;
- `<!-- guide-test: on mac-b -->`        run on the second host (another HOME on this machine);
- `<!-- guide-test: background -->`      a command that serves until stopped: started, left running.

Host names and ports are rewritten to loopback and free ports (`substitutions`). The second host is
reached through an `ssh` stand-in that runs the remote command locally under that host's HOME, and
`launchctl bootstrap/bootout` through a stand-in that does what launchd does with the plist: parse
it, start ProgramArguments with its environment, working directory and log files, stop with SIGTERM.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

DIRECTIVE = re.compile(r"<!--\s*guide-test:\s*(\w[\w-]*)\s*(.*?)\s*-->")
FENCE = re.compile(r"^```(\w*)\s*$")


@dataclass
class Block:
    kind: str  # the fence's language: bash, toml, ...
    text: str
    directive: str = ""  # skip, file, on, background, or "" (run on the first host)
    argument: str = ""


def guide_blocks(markdown: str) -> list[Block]:
    blocks, lines, index = [], markdown.splitlines(), 0
    while index < len(lines):
        opened = FENCE.match(lines[index])
        if not opened:
            index += 1
            continue
        before = next((line for line in reversed(lines[:index]) if line.strip()), "")
        found = DIRECTIVE.search(before)
        end = next(i for i in range(index + 1, len(lines)) if lines[i].startswith("```"))
        blocks.append(
            Block(
                opened.group(1),
                "\n".join(lines[index + 1 : end]) + "\n",
                found.group(1) if found else "",
                found.group(2) if found else "",
            )
        )
        index = end + 1
    return blocks


SSH_STAND_IN = """#!/bin/sh
# ssh HOST COMMAND: the second host is this machine under another HOME
while [ "${1#-}" != "$1" ]; do shift; done
shift
HOME="$GUIDE_REMOTE_HOME" exec sh -c "$*"
"""

LAUNCHCTL_STAND_IN = textwrap.dedent(
    """\
    #!{python}
    # launchctl bootstrap gui/UID PLIST | bootout gui/UID/LABEL, as launchd would run the plist
    import os, plistlib, signal, subprocess, sys, time
    from pathlib import Path
    state = Path(os.environ["GUIDE_LAUNCHD_STATE"])
    verb, target = sys.argv[1], sys.argv[2]
    if verb == "bootstrap":
        plist = plistlib.loads(Path(sys.argv[3]).read_bytes())
        env = {{"HOME": os.environ["HOME"], **plist["EnvironmentVariables"]}}
        out = open(plist["StandardOutPath"], "ab")
        err = open(plist["StandardErrorPath"], "ab")
        proc = subprocess.Popen(plist["ProgramArguments"], env=env, cwd=plist["WorkingDirectory"],
                                stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True)
        (state / (plist["Label"] + ".pid")).write_text(str(proc.pid))
        (state / (plist["Label"] + ".stop")).write_text(str(plist["ExitTimeOut"]))
    elif verb == "bootout":
        label = target.rsplit("/", 1)[1]
        pid, limit = int((state / (label + ".pid")).read_text()), float((state / (label + ".stop")).read_text())
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            os.kill(pid, signal.SIGKILL)
        (state / (label + ".pid")).unlink()
    else:
        sys.exit(f"launchctl stand-in: {{verb}} is not supported")
    """
)


@dataclass
class GuideRun:
    """One run of a guide: host folders, stand-ins and whatever it left running."""

    root: Path
    env: dict[str, str]
    substitutions: dict[str, str]

    def __post_init__(self):
        self.homes = {"mac-a": self.root / "mac-a", "mac-b": self.root / "mac-b"}
        for home in self.homes.values():
            home.mkdir(parents=True, exist_ok=True)
        self.bin = self.root / "bin"
        self.bin.mkdir(exist_ok=True)
        self.state = self.root / "launchd"
        self.state.mkdir(exist_ok=True)
        (self.bin / "ssh").write_text(SSH_STAND_IN)
        (self.bin / "launchctl").write_text(LAUNCHCTL_STAND_IN.format(python=sys.executable))
        for tool in ("ssh", "launchctl"):
            (self.bin / tool).chmod(0o755)
        self.background: list[subprocess.Popen] = []
        self.outputs: list[str] = []

    def rewrite(self, text: str) -> str:
        for old, new in self.substitutions.items():
            text = re.sub(rf"(?<![\w.]){re.escape(old)}(?![\w])", new, text)
        return text

    def host_env(self, host: str) -> dict[str, str]:
        return {
            **self.env,
            "HOME": str(self.homes[host]),
            "PATH": os.pathsep.join([str(self.bin), str(Path(sys.executable).parent), self.env["PATH"]]),
            "GUIDE_REMOTE_HOME": str(self.homes["mac-b"]),
            "GUIDE_LAUNCHD_STATE": str(self.state),
        }

    def run(self, markdown: str, timeout: float = 300) -> None:
        for block in guide_blocks(markdown):
            text = self.rewrite(block.text)
            host = "mac-b" if block.directive == "on" and block.argument == "mac-b" else "mac-a"
            if block.directive == "skip":
                continue
            if block.directive == "file":
                path = Path(block.argument.replace("~", str(self.homes[host]), 1))
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
                continue
            assert block.kind == "bash", f"a {block.kind} block with no guide-test directive:\n{text}"
            command = ["bash", "-e", "-o", "pipefail", "-c", text]
            if block.directive == "background":
                log = open(self.root / f"background-{len(self.background)}.log", "wb")
                self.background.append(
                    subprocess.Popen(
                        command,
                        env=self.host_env(host),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
                continue
            done = subprocess.run(
                command, env=self.host_env(host), check=False, capture_output=True, text=True, timeout=timeout
            )
            assert done.returncode == 0, (
                f"guide command failed ({done.returncode}):\n{text}\n{done.stdout}\n{done.stderr}"
            )
            self.outputs.append(done.stdout)

    def stop(self) -> None:
        """Stop what the guide left running: background commands (Ctrl-C) and launchd services."""
        for proc in self.background:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
        for pid_file in self.state.glob("*.pid"):
            try:
                os.kill(int(pid_file.read_text()), signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 30
        for proc in self.background:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
