"""Faults injected while the soak runs (bench/soak.py --chaos-every): every `every_s` seconds, in
turn, kill -9 a worker, SIGSTOP another for 5 s, or kill -9 core (`--chaos-actions` picks which).
`moe-mesh up` starts what died again. With `up --replicas 2` a worker's fault must fail no request.
`delay_link` (bench/soak_link.py, whose worker link runs through bench/delay_relay.py) adds
DELAY_MS to every byte on that link for DELAY_S, connections kept open: it must fail no request.

An error is the fault's when the request overlapped the fault's window (the fault, until the
process is back and `CHAOS_WINDOW_S` more); the figure that must be zero is errors outside every
window. Recovery is measured from each fault to the end of the first request, begun after it, that
succeeded."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass

from bench.soak_traffic import EXPECTED, Outcome

CHAOS_WINDOW_S = 60.0  # after a fault: a restart (a core loads its model) plus requests then in flight
STOP_S = 5.0
DELAY_MS, DELAY_S = 50.0, 10.0
FAULT_ERRORS = {"http_503", "RemoteProtocolError", "ReadError"}  # 503 naming the cause, or a cut stream


@dataclass
class Fault:
    t: float  # time.monotonic()
    action: str
    target: str


ACTIONS = ("kill_worker", "stop_worker", "kill_core")  # what `moe-mesh up` recovers from
LINK_ACTIONS = ("delay_link",)  # a relay's link (bench/soak_link.py)


async def inject(
    pids_of, stop_at: float, every_s: float, faults: list[Fault], actions: tuple[str, ...] = ACTIONS
) -> None:
    """Until `stop_at`, one fault every `every_s`, taking `actions` in turn: `pids_of(role)` finds
    the current processes."""
    unknown = set(actions) - set(ACTIONS + LINK_ACTIONS)
    if unknown or not actions:
        known = ", ".join(ACTIONS + LINK_ACTIONS)
        raise ValueError(f"chaos actions must be some of {known}, not {sorted(unknown)}")
    if "delay_link" in actions and not pids_of("relay"):
        raise ValueError("delay_link needs a worker link through bench/delay_relay.py (bench/soak_link.py)")
    turn = 0
    while time.monotonic() + every_s < stop_at:
        await asyncio.sleep(every_s)
        action = actions[turn % len(actions)]
        turn += 1
        workers = sorted(pids_of("expert"))
        if action == "delay_link":
            relay = pids_of("relay")[0]
            faults.append(
                Fault(time.monotonic(), action, f"{DELAY_MS:.0f} ms on a worker link for {DELAY_S:.0f} s")
            )
            os.kill(relay, signal.SIGUSR1)
            await asyncio.sleep(DELAY_S)
            os.kill(relay, signal.SIGUSR2)
        elif action == "kill_core":
            pid = pids_of("core")[0]
            faults.append(Fault(time.monotonic(), action, f"core pid {pid}"))
            os.kill(pid, signal.SIGKILL)
        elif action == "kill_worker":
            pid = workers[turn % len(workers)]
            faults.append(Fault(time.monotonic(), action, f"worker pid {pid}"))
            os.kill(pid, signal.SIGKILL)
        else:
            pid = workers[(turn + 1) % len(workers)]
            faults.append(Fault(time.monotonic(), action, f"worker pid {pid} for {STOP_S:.0f} s"))
            os.kill(pid, signal.SIGSTOP)
            await asyncio.sleep(STOP_S)
            os.kill(pid, signal.SIGCONT)


def judge(outcomes: list[Outcome], faults: list[Fault]) -> dict:
    """Errors inside and outside the faults' windows, and each fault's recovery time."""
    inside, outside, kinds = 0, 0, {}
    by_action = {f.action: 0 for f in faults}  # errors of requests that overlapped such a fault
    for o in outcomes:
        if o.outcome in EXPECTED:
            continue
        end = o.started_at + o.seconds
        overlapping = [f for f in faults if f.t <= end and o.started_at <= f.t + CHAOS_WINDOW_S]
        if overlapping and o.outcome in FAULT_ERRORS:
            inside += 1
            by_action[overlapping[-1].action] += 1
        else:
            outside += 1
        key = f"{'during' if overlapping else 'outside'}:{o.outcome}"
        kinds[key] = kinds.get(key, 0) + 1
    recoveries = []
    for f in faults:
        ends = [o.started_at + o.seconds for o in outcomes if o.outcome == "ok" and o.started_at >= f.t]
        recoveries.append(
            {
                "action": f.action,
                "target": f.target,
                "recovered_s": round(min(ends) - f.t, 1) if ends else None,
            }
        )
    return {
        "faults": recoveries,
        "errors_in_fault_windows": inside,
        "errors_outside_fault_windows": outside,
        "errors_by_window": kinds,
        "errors_by_fault": by_action,
    }
