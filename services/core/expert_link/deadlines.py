"""Deadlines for the expert links' attempts in flight, kept by one loop timer instead of one per call.

`asyncio.timeout` arms and cancels a loop timer around every await: ~16 us per layer call on
uvloop here, more than the rest of an attempt's bookkeeping together, for a deadline that
almost never fires (calls take milliseconds, deadlines are seconds).
"""

from __future__ import annotations

import asyncio


class AttemptDeadlines:
    """Cancels a task whose attempt outlives its deadline; an attempt that ends in time costs
    two dict operations.

    One timer serves every attempt in flight: it fires at the earliest deadline armed,
    cancels the tasks that are overdue and re-arms itself for the next deadline, if any.
    Contract, on the loop's thread only: `watch(task, budget_s)` before the attempt's awaits,
    `forget(task)` after them (always, in `finally`); when the attempt is cancelled,
    `expired(task)` says whether this deadline did it (then call `task.uncancel()` and report
    the timeout) or something else did (then let the cancellation through).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._deadlines: dict[asyncio.Task, float] = {}
        self._expired: set[asyncio.Task] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")

    def watch(self, task: asyncio.Task, budget_s: float) -> None:
        deadline = self._loop.time() + budget_s
        self._deadlines[task] = deadline
        if deadline < self._timer_at:
            self._arm(deadline)

    def forget(self, task: asyncio.Task) -> None:
        self._deadlines.pop(task, None)
        self._expired.discard(task)

    def expired(self, task: asyncio.Task) -> bool:
        return task in self._expired

    def __len__(self) -> int:
        return len(self._deadlines)

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = self._loop.call_at(when, self._fire), when

    def _fire(self) -> None:
        self._timer, self._timer_at = None, float("inf")
        now = self._loop.time()
        for task, deadline in list(self._deadlines.items()):
            if deadline <= now:
                del self._deadlines[task]
                self._expired.add(task)
                task.cancel()
        if self._deadlines:
            self._arm(min(self._deadlines.values()))
