"""Micro-batches in ping-pong: while one lane's experts compute on the workers, the other lane's
attention computes in core.

An engine step with `--micro-batches 2` runs its forwards in two lanes (kind_batches.py puts each
sequence in one). Within a lane, forwards share one expert call per layer, as `run_side_by_side`
merges them. Across lanes the calls are pipelined: lane A runs to its first MoE layer and sends
its call; lane B does the same; core then reads A's answer, runs A on to its next MoE layer and
sends that call, reads B's answer, and so on. The worker always has the other lane's call queued
behind the one it computes, and core's attention for one lane overlaps the experts of the other,
as MegaScale-Infer's ping-pong pipeline does. Answers are read in the order calls were sent.

A call goes out behind another only where the dispatcher says it can (`queues_behind`: frame
sockets with room in their send buffers); otherwise the earlier answer is read first, and the
lanes simply take turns. A dispatcher without `start_call` answers each call when it is made.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.core.expert_link.in_flight import drop_pending
from services.core.expert_link.metrics import LAYER_CALLS_PIPELINED
from services.core.expert_link.step_merge import (
    START,
    Forward,
    Waiting,
    merged_inputs,
    resume_forward,
    run_side_by_side,
    split_answer,
    take_lowest_layer,
)


@dataclass
class _LaneCall:
    """One lane's merged layer call: sent, and answered once `read()` returns."""

    lane: int
    group: list[int]  # the forwards it carries
    parts: list[Waiting]
    pending: object | None = None  # the dispatcher's PendingCall while its answer is unread
    answer: object = None  # [T, k, H] rows, or the error each forward of the call raises

    def read(self) -> object:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            try:
                self.answer = self.parts[0].dispatcher.finish(pending)
            except Exception as error:  # noqa: BLE001 - raised again inside each forward of the call
                self.answer = error
        return self.answer

    def abandon(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self.parts[0].dispatcher.abandon(pending)


def run_in_lanes(tasks: Sequence[Callable[[], object]], lanes: Sequence[int]) -> list:
    """`run_side_by_side` with the tasks split into lanes (`lanes[i]`: task i's) whose expert calls
    are pipelined; one lane is exactly `run_side_by_side`."""
    if len(set(lanes)) <= 1:
        return run_side_by_side(tasks)
    try:
        return _run_in_lanes(tasks, lanes)
    except BaseException:
        drop_pending()
        raise


def _run_in_lanes(tasks: Sequence[Callable[[], object]], lanes: Sequence[int]) -> list:
    forwards = [Forward(task) for task in tasks]
    results: list = [None] * len(tasks)
    resume: dict[int, object] = {index: START for index in range(len(tasks))}
    waiting: dict[int, Waiting] = {}
    in_flight: deque[_LaneCall] = deque()  # in the order sent, so answers are read in that order
    try:
        while True:
            for lane in sorted(set(lanes)):
                mine = [index for index in resume if lanes[index] == lane]
                for index in mine:
                    outcome = resume_forward(forwards[index], resume[index])
                    if isinstance(outcome, Waiting) and not forwards[index].dead:
                        waiting[index] = outcome
                    else:
                        results[index] = outcome
                lane_waiting = {i: w for i, w in waiting.items() if lanes[i] == lane}
                if mine and lane_waiting:
                    for index in lane_waiting:
                        del waiting[index]
                    in_flight.append(_send(lane, lane_waiting, in_flight))
                    waiting.update(lane_waiting)  # those the call does not carry wait on
            if not in_flight:
                return results
            call = in_flight.popleft()
            resume = split_answer(call.group, call.parts, call.read())
    except BaseException:
        for call in in_flight:
            call.abandon()
        for forward in forwards:
            if not forward.dead:
                forward.throw()
        raise


def _send(lane: int, lane_waiting: dict[int, Waiting], in_flight: deque[_LaneCall]) -> _LaneCall:
    """Send the lane's call for its lowest waiting layer (taking those forwards out of
    `lane_waiting`), behind the calls in flight where the dispatcher allows it."""
    group, parts = take_lowest_layer(lane_waiting)
    call = _LaneCall(lane, group, parts)
    dispatcher, layer = parts[0].dispatcher, parts[0].layer
    hidden, expert_ids = merged_inputs(parts)
    start = getattr(dispatcher, "start_call", None)
    try:
        if start is None:
            call.answer = dispatcher.call_overlapped(layer, hidden, expert_ids)
            return call
        nbytes = hidden.nbytes + expert_ids.nbytes
        for earlier in in_flight:
            same_link = earlier.parts[0].dispatcher is dispatcher and earlier.pending is not None
            if same_link and not dispatcher.queues_behind(earlier.pending, nbytes):
                earlier.read()
        call.pending = start(layer, hidden, expert_ids)
        if any(earlier.pending is not None for earlier in in_flight):
            LAYER_CALLS_PIPELINED.inc()
    except Exception as error:  # noqa: BLE001 - raised again inside each forward of the call
        call.answer = error
    return call
