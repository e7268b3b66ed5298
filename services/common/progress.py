"""A dependency-free progress bar for long work (split, demo model build)."""

from __future__ import annotations

import sys
import time


class Progress:
    """Redraws one stderr line; on a non-terminal prints at most every few seconds."""

    def __init__(self, label: str, total: int, unit: str = "", enabled: bool = True):
        self.label, self.total, self.unit, self.enabled = label, max(total, 1), unit, enabled
        self.done = 0
        self.bytes = 0
        self.started = time.monotonic()
        self._last_draw = 0.0
        self._tty = sys.stderr.isatty()

    def advance(self, steps: int = 1, nbytes: int = 0) -> None:
        self.done += steps
        self.bytes += nbytes
        now = time.monotonic()
        if self.enabled and (self.done >= self.total or now - self._last_draw > (0.1 if self._tty else 5.0)):
            self._last_draw = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        frac = min(self.done / self.total, 1.0)
        bar = "#" * int(frac * 30)
        elapsed = now - self.started
        rate = f" {self.bytes / max(elapsed, 1e-9) / 1e6:.0f} MB/s" if self.bytes else ""
        line = f"{self.label} [{bar:<30}] {self.done}/{self.total} {self.unit}{rate} {elapsed:.1f}s"
        end = "\n" if (not self._tty or self.done >= self.total) else ""
        sys.stderr.write(("\r" if self._tty else "") + line + end)
        sys.stderr.flush()
