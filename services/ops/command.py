"""How moe-mesh starts itself: the command line of one `moe-mesh` invocation."""

from __future__ import annotations

import sys


def cli_command(*args: str) -> list[str]:
    """The command line that runs `moe-mesh ARGS` with this Python, as `up` and the rendered
    launchd/systemd services start it. -P: a `services/` folder in the working directory is not
    imported in place of moe-mesh's own."""
    return [sys.executable, "-P", "-m", "services.ops.cli", *args]
