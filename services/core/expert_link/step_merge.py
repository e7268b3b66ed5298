"""One expert call per worker per layer for everything an engine step computes, and micro-batches
whose calls pipeline.

A step can run up to three model forwards per batch (batch_step.py):
the decode of the running sequences, the first token of prompts that just finished
prefilling, and the next prefill chunk, plus the same again for each KV cache kind. Run
one after another, each forward makes its own expert call per layer. `run_side_by_side`
runs them as greenlets on the engine thread instead: each forward runs until its next
MoE layer needs the experts, hands its hidden states over and pauses; once every
forward waits at that layer, one call carries all their tokens (the worker computes the
tokens routed to one expert together) and each forward resumes with its rows.

With `--micro-batches 2` the forwards come in two lanes (kind_batches.py puts each sequence in
one). Forwards merge within a lane; across lanes the calls pipeline, ping-pong as in
MegaScale-Infer: lane A sends its call, lane B runs to its MoE layer and sends its own, then A's
answer is read and A runs on to its next layer while the worker computes B's experts. Answers are
read in the order the calls were sent. A call goes out behind another only where the dispatcher
says it can (`queues_behind`: frame sockets with room in their send buffers); otherwise the
earlier answer is read first. A dispatcher without `start_call` answers each call when it is made.

Greenlets, not threads: MLX graph building and evaluation stay on one OS thread and
only one forward runs at a time, so nothing in mlx-lm's model code needs to be
thread-safe. Forwards of one model visit the MoE layers in the same order, so they
meet at every layer; if they do not (a forward ends early), the call simply carries
fewer forwards.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx
from greenlet import greenlet

from services.core.expert_link.in_flight import drop_pending
from services.core.expert_link.metrics import LAYER_CALLS_PIPELINED

_START = object()


class _Forward(greenlet):
    """A greenlet whose expert calls go to the step's hub instead of straight out."""


@dataclass
class _Waiting:
    dispatcher: object
    layer: int
    hidden: mx.array
    expert_ids: mx.array


@dataclass
class _Call:
    """One lane's merged layer call; answered once `read()` returns."""

    group: list[int]  # the forwards it carries
    parts: list[_Waiting]
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


def expert_call(dispatcher, layer: int, hidden: mx.array, expert_ids: mx.array) -> mx.array:
    """What `RemoteExperts` (and `DistributedExperts`) call: hidden [T, H] and expert_ids [T, k]
    -> [T, k, H]; evaluated inputs (hidden in wire form) unless the dispatcher's
    `needs_evaluated_inputs` is False. Inside `run_side_by_side` the call joins the layer's merged
    call; anywhere else it is a plain `dispatcher.call_overlapped`."""
    current = greenlet.getcurrent()
    if isinstance(current, _Forward):
        return current.parent.switch(_Waiting(dispatcher, layer, hidden, expert_ids))
    return dispatcher.call_overlapped(layer, hidden, expert_ids)


def run_side_by_side(tasks: Sequence[Callable[[], object]], lanes: Sequence[int] | None = None) -> list:
    """Run `tasks` (each may run model forwards) with their expert calls merged per layer within
    a lane and pipelined across lanes (`lanes[i]`: task i's; default one lane); returns their
    results in order. The first error any task or call raises is raised here after every other
    task has been unwound."""
    try:
        if len(tasks) <= 1:
            return [task() for task in tasks]
        return _run(tasks, lanes or [0] * len(tasks))
    except BaseException:
        drop_pending()  # a failed forward may leave its last expert call unread
        raise


def _run(tasks: Sequence[Callable[[], object]], lanes: Sequence[int]) -> list:
    forwards = [_Forward(task) for task in tasks]
    results: list = [None] * len(tasks)
    resume: dict[int, object] = {index: _START for index in range(len(tasks))}  # index -> value to send
    waiting: dict[int, _Waiting] = {}
    in_flight: deque[_Call] = deque()  # in the order sent, so answers are read in that order
    order = sorted(set(lanes))
    pipelined = len(order) > 1
    try:
        while True:
            for lane in order:
                mine = [index for index in resume if lanes[index] == lane]
                for index in mine:
                    outcome = _resume(forwards[index], resume[index])
                    if isinstance(outcome, _Waiting) and not forwards[index].dead:
                        waiting[index] = outcome
                    else:
                        results[index] = outcome
                lane_waiting = [index for index in waiting if lanes[index] == lane]
                if mine and lane_waiting:
                    in_flight.append(_send(waiting, lane_waiting, in_flight, pipelined))
            if not in_flight:
                return results
            call = in_flight.popleft()
            resume = _split_answer(call, call.read())
    except BaseException:
        for call in in_flight:
            call.abandon()
        for forward in forwards:
            if not forward.dead:
                forward.throw()  # GreenletExit: unwinds its stack, runs its finally blocks
        raise


def _resume(forward: _Forward, value) -> object:
    """Run `forward` until it waits at an expert call (returns that `_Waiting`) or ends (returns
    its result); `value` is _START, the rows it waited for, or the error to raise inside it."""
    if value is _START:
        return forward.switch()
    if isinstance(value, BaseException):
        return forward.throw(value)
    return forward.switch(value)


def _send(waiting: dict[int, _Waiting], lane: list[int], in_flight: deque[_Call], pipelined: bool) -> _Call:
    """One call for the forwards of `lane` (indices into `waiting`) that wait at its lowest layer
    on one dispatcher, taken out of `waiting`. Unless `pipelined`, the call is answered at once
    (`call_overlapped`); otherwise it is sent behind the calls in flight where it may queue."""
    first = min((waiting[i] for i in lane), key=lambda w: w.layer)
    group = [i for i in lane if waiting[i].layer == first.layer and waiting[i].dispatcher is first.dispatcher]
    call = _Call(group, [waiting.pop(i) for i in group])
    dispatcher, hidden, expert_ids = first.dispatcher, *_merged_inputs(call.parts)
    start = getattr(dispatcher, "start_call", None) if pipelined else None
    try:
        if start is None:
            call.answer = dispatcher.call_overlapped(first.layer, hidden, expert_ids)
            return call
        for earlier in in_flight:
            unread = earlier.pending is not None and earlier.parts[0].dispatcher is dispatcher
            if unread and not dispatcher.queues_behind(earlier.pending, hidden.nbytes + expert_ids.nbytes):
                earlier.read()
        call.pending = start(first.layer, hidden, expert_ids)
        if any(earlier.pending is not None for earlier in in_flight):
            LAYER_CALLS_PIPELINED.inc()
    except Exception as error:  # noqa: BLE001 - raised again inside each forward of the call
        call.answer = error
    return call


def _merged_inputs(parts: list[_Waiting]) -> tuple[mx.array, mx.array]:
    """One call's hidden states and expert ids: every part's, in order."""
    if len(parts) == 1:
        return parts[0].hidden, parts[0].expert_ids
    hidden = mx.concatenate([p.hidden for p in parts])
    expert_ids = mx.concatenate([p.expert_ids for p in parts])
    if getattr(parts[0].dispatcher, "needs_evaluated_inputs", True):
        mx.eval(hidden, expert_ids)  # of evaluated inputs: each forward settled before its own eval
    return hidden, expert_ids


def _split_answer(call: _Call, out) -> dict[int, object]:
    """Each forward's rows of the call's answer (or the call's error, for each of them)."""
    if isinstance(out, BaseException):
        return {i: out for i in call.group}
    resume, start = {}, 0
    for i, part in zip(call.group, call.parts, strict=True):
        rows = part.hidden.shape[0]
        resume[i] = out[start : start + rows]
        start += rows
    return resume
