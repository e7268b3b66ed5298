"""Start-up progress as log events, so every way of running a service shows it the same way.

Each service logs `load` events while it starts: `stage` is one of LOAD_STAGES, `done`/`total`
count what the stage works through (layers read), and the last event of a stage has
`done == total`. `moe-mesh up` relays these lines from its services' log files to its terminal;
launchd and systemd keep them in the service's own log.
"""

from __future__ import annotations

import time

from services.common.logging import get_logger

log = get_logger("load")
LOAD_EVENT = "load"
LOAD_STAGES = ("weights_read", "experts_mapped", "kernels_ready", "serving")


class LoadProgress:
    """Logs one stage's progress: at most every `every_s` seconds, and always when it completes."""

    def __init__(self, stage: str, total: int, unit: str = "layers", every_s: float = 2.0, **fields):
        if stage not in LOAD_STAGES:
            raise ValueError(f"unknown load stage {stage!r}")
        self.stage, self.total, self.unit, self.every_s, self.fields = stage, total, unit, every_s, fields
        self.done = 0
        self.nbytes = 0
        self.started = time.monotonic()
        self._last = self.started

    def advance(self, steps: int = 1, nbytes: int = 0) -> None:
        self.done += steps
        self.nbytes += nbytes
        now = time.monotonic()
        if self.done >= self.total or now - self._last >= self.every_s:
            self._last = now
            self._log(now)

    def _log(self, now: float) -> None:
        extra = {"gb": round(self.nbytes / 1e9, 3)} if self.nbytes else {}
        log.info(
            LOAD_EVENT,
            stage=self.stage,
            done=self.done,
            total=self.total,
            unit=self.unit,
            seconds=round(now - self.started, 2),
            **extra,
            **self.fields,
        )


def load_stage_done(stage: str, seconds: float | None = None, **fields) -> None:
    """A stage that completes in one piece (no counting)."""
    if stage not in LOAD_STAGES:
        raise ValueError(f"unknown load stage {stage!r}")
    timing = {} if seconds is None else {"seconds": round(seconds, 2)}
    log.info(LOAD_EVENT, stage=stage, **timing, **fields)
