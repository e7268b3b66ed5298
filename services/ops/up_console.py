"""What `moe-mesh up` shows and keeps: its services' logs in a folder that outlives the run, and
their progress on its own terminal.

Each service writes JSON lines to `<logs>/<service>.log`. `LogRelay` follows those files and
prints the lines an operator watches for: start-up progress (`load` events), the stats line
(`stats`), workers going and coming, and errors, readable on a terminal or as the JSON lines
themselves when `up` logs JSON.
"""

from __future__ import annotations

import json
import shutil
import sys
import threading
from datetime import datetime
from pathlib import Path

KEEP_RUNS = 20  # log folders of earlier runs kept under $MOE_MESH_CACHE/logs
RELAYED_EVENTS = frozenset(
    {"load", "stats", "workers_changed", "workers_ready", "expert_worker_down", "expert_worker_up"}
)
RELAYED_LEVELS = frozenset({"error", "critical"})
LOAD_DETAILS = (
    "model",
    "layers",
    "experts",
    "resident_gb",
    "workers",
    "expert_kernel",
    "kv_cache",
    "address",
)


def new_log_dir(root: Path, keep: int = KEEP_RUNS) -> Path:
    """A new folder under `root` named for this start time; the oldest runs beyond `keep` go.

    Runs started in the same millisecond get `_2`, `_3`, ... past the highest such suffix still
    on disk, so a pruned name is never handed out again and names keep sorting by start.
    """
    root.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S.%f")[:-3]  # fixed width: names sort by time
    taken = [_run_order(p.name)[1] for p in root.iterdir() if _run_order(p.name)[0] == stamp]
    n = max(taken, default=0) + 1
    path = root / (stamp if n == 1 else f"{stamp}_{n}")
    path.mkdir()
    prune_log_dirs(root, keep)
    return path


def _run_order(name: str) -> tuple[str, int]:
    """(start stamp, run number within that millisecond) of a run folder's name."""
    head, sep, tail = name.rpartition("_")
    if sep and tail.isdigit() and "." in head:  # "<date>_<time>.<ms>_<n>"
        return head, int(tail)
    return name, 1


def prune_log_dirs(root: Path, keep: int) -> list[Path]:
    """Remove all but the newest `keep` run folders (by start time, then run number)."""
    runs = sorted(
        (p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")),
        key=lambda p: _run_order(p.name),
    )
    removed = runs[: max(0, len(runs) - keep)]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def readable(service: str, event: dict) -> str | None:
    """One relayed line for a terminal, or None when `event` is not one the operator watches."""
    name = event.get("event")
    level = event.get("level", "info")
    if name not in RELAYED_EVENTS and level not in RELAYED_LEVELS:
        return None
    if name == "load":
        stage = str(event.get("stage", "")).replace("_", " ")
        parts = [stage]
        if "total" in event:
            parts.append(f"{event.get('done')}/{event['total']} {event.get('unit', '')}".rstrip())
        if "gb" in event:
            parts.append(f"{event['gb']:g} GB")
        if "total" not in event:  # a stage done in one piece: what it did
            parts += [f"{key.replace('_', ' ')} {event[key]}" for key in LOAD_DETAILS if key in event]
        if "seconds" in event:
            parts.append(f"({event['seconds']} s)")
        return f"[{service}] " + " ".join(parts)
    if name == "stats":
        return f"[{service}] " + stats_text(event)
    parts = [level] if level in RELAYED_LEVELS else []
    parts.append(str(name))
    parts += [
        f"{k}={v}" for k, v in event.items() if k not in ("event", "level", "timestamp", "service", "logger")
    ]
    return f"[{service}] " + " ".join(parts)


def stats_text(event: dict) -> str:
    def pct(key: str) -> str:
        return "-" if event.get(key) is None else f"{event[key]}%"

    text = (
        f"prompt {event.get('prompt_tok_s', 0)} tok/s, generation {event.get('generation_tok_s', 0)} tok/s, "
        f"running {event.get('running', 0)}, waiting {event.get('waiting', 0)}, KV {pct('kv_cache_pct')}, "
        f"prefix hits {pct('prefix_cache_hit_pct')}"
    )
    if "draft_acceptance_pct" in event:
        text += f", drafts accepted {pct('draft_acceptance_pct')}"
    if "hop_p50_us" in event:
        text += f", hop p50 {event['hop_p50_us']} us"
    if "ssd_gb_s" in event:
        text += f", expert cache hits {pct('expert_cache_hit_pct')}, SSD {event['ssd_gb_s']} GB/s"
    if event.get("workers_down"):
        text += f", down: {', '.join(event['workers_down'])}"
    return text


class LogRelay:
    """Follows the services' log files on a thread and prints what `readable` keeps."""

    def __init__(self, as_json: bool = False, out=None, poll_s: float = 0.2):
        self.as_json = as_json
        self.out = out or sys.stderr
        self.poll_s = poll_s
        self._files: dict[str, tuple[Path, int]] = {}  # service -> (log, offset read up to)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="log-relay", daemon=True)

    def follow(self, service: str, path: Path) -> None:
        """Relay `path` from its current end (a restarted service appends to the same file)."""
        with self._lock:
            if service not in self._files:
                self._files[service] = (path, path.stat().st_size if path.exists() else 0)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)
        self.relay_once()  # what the services wrote while stopping

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.relay_once()

    def relay_once(self) -> None:
        with self._lock:
            files = dict(self._files)
        for service, (path, offset) in files.items():
            try:
                with open(path, "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
            except OSError:
                continue
            complete = chunk[: chunk.rfind(b"\n") + 1]  # a line being written waits for its end
            with self._lock:
                self._files[service] = (path, offset + len(complete))
            for raw in complete.splitlines():
                self._print(service, raw)

    def _print(self, service: str, raw: bytes) -> None:
        try:
            event = json.loads(raw)
        except ValueError:
            return  # not a log event (a library's own print)
        if not isinstance(event, dict):
            return
        line = readable(service, event)
        if line is None:
            return
        try:
            # as JSON, the line names the process too ("expert-1"; its own `service` is its role)
            self.out.write((json.dumps({**event, "process": service}) if self.as_json else line) + "\n")
            self.out.flush()
        except (OSError, ValueError):
            pass
