"""One timer keeps every in-flight attempt's deadline (no sockets)."""

from __future__ import annotations

import asyncio
import time

from services.core.expert_link.deadlines import AttemptDeadlines


async def _attempt(deadlines: AttemptDeadlines, budget_s: float, work_s: float) -> str:
    """What ExpertDispatcher._attempt does around its awaits: 'done', 'timeout' or a re-raise."""
    task = asyncio.current_task()
    deadlines.watch(task, budget_s)
    try:
        await asyncio.sleep(work_s)
        return "done"
    except asyncio.CancelledError:
        if not deadlines.expired(task):
            raise
        task.uncancel()
        await asyncio.sleep(0)  # the task can await again after a deadline
        return "timeout"
    finally:
        deadlines.forget(task)


async def test_overdue_attempts_time_out_at_their_own_deadline_and_others_finish():
    deadlines = AttemptDeadlines(asyncio.get_running_loop())
    started = time.monotonic()
    long_budget = asyncio.create_task(_attempt(deadlines, budget_s=5.0, work_s=0.3))
    await asyncio.sleep(0.01)
    # armed after a later deadline, this earlier one must still fire on time
    short_budget = asyncio.create_task(_attempt(deadlines, budget_s=0.1, work_s=10.0))
    assert await short_budget == "timeout"
    assert 0.09 <= time.monotonic() - started < 0.3
    assert await long_budget == "done"
    assert len(deadlines) == 0


async def test_many_quick_attempts_leave_nothing_behind_and_a_later_one_still_times_out():
    deadlines = AttemptDeadlines(asyncio.get_running_loop())
    for _ in range(200):
        assert await _attempt(deadlines, budget_s=0.05, work_s=0) == "done"
    assert len(deadlines) == 0
    started = time.monotonic()
    assert await _attempt(deadlines, budget_s=0.1, work_s=10.0) == "timeout"
    assert time.monotonic() - started < 0.5


async def test_a_cancellation_that_is_not_the_deadline_goes_through():
    deadlines = AttemptDeadlines(asyncio.get_running_loop())
    task = asyncio.create_task(_attempt(deadlines, budget_s=10.0, work_s=10.0))
    await asyncio.sleep(0.01)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    else:  # pragma: no cover - the assertion below says what went wrong
        raise AssertionError("the caller's cancellation was swallowed")
    assert task.cancelled() and len(deadlines) == 0
