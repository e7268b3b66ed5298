"""One expert call per worker per layer for everything an engine step computes.

A step can run up to three model forwards per batch (mlx-lm's `BatchGenerator._next`):
the decode of the running sequences, the first token of prompts that just finished
prefilling, and the next prefill chunk, plus the same again for each KV cache kind. Run
one after another, each forward makes its own expert call per layer. `run_side_by_side`
runs them as greenlets on the engine thread instead: each forward runs until its next
MoE layer needs the experts, hands its hidden states over and pauses; once every
forward waits at that layer, one call carries all their tokens (the worker computes the
tokens routed to one expert together) and each forward resumes with its rows.

Greenlets, not threads: MLX graph building and evaluation stay on one OS thread and
only one forward runs at a time, so nothing in mlx-lm's model code needs to be
thread-safe. Forwards of one model visit the MoE layers in the same order, so they
meet at every layer; if they do not (a forward ends early), the call simply carries
fewer forwards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx
from greenlet import greenlet

from services.core.expert_link.in_flight import drop_pending

_START = object()


class _Forward(greenlet):
    """A greenlet whose expert calls go to the step's hub instead of straight out."""


@dataclass
class _Waiting:
    dispatcher: object
    layer: int
    hidden: mx.array
    expert_ids: mx.array


def expert_call(dispatcher, layer: int, hidden: mx.array, expert_ids: mx.array) -> mx.array:
    """What `RemoteExperts` (and `DistributedExperts`) call: hidden [T, H] and expert_ids [T, k]
    -> [T, k, H]; evaluated inputs (hidden in wire form) unless the dispatcher's
    `needs_evaluated_inputs` is False. Inside `run_side_by_side` the call joins the layer's merged
    call; anywhere else it is a plain `dispatcher.call_overlapped`."""
    current = greenlet.getcurrent()
    if isinstance(current, _Forward):
        return current.parent.switch(_Waiting(dispatcher, layer, hidden, expert_ids))
    return dispatcher.call_overlapped(layer, hidden, expert_ids)


def run_side_by_side(tasks: Sequence[Callable[[], object]]) -> list:
    """Run `tasks` (each may run model forwards) with their expert calls merged per layer;
    returns their results in order. The first error any task or merged call raises is
    raised here after every other task has been unwound."""
    try:
        return _run_side_by_side(tasks)
    except BaseException:
        drop_pending()  # a failed forward may leave its last expert call unread
        raise


def _run_side_by_side(tasks: Sequence[Callable[[], object]]) -> list:
    if len(tasks) <= 1:
        return [task() for task in tasks]
    forwards = [_Forward(task) for task in tasks]
    results: list = [None] * len(tasks)
    resume: dict[int, object] = {index: _START for index in range(len(tasks))}  # index -> value to send
    waiting: dict[int, _Waiting] = {}
    try:
        while resume:
            for index, value in resume.items():
                if value is _START:
                    outcome = forwards[index].switch()
                elif isinstance(value, BaseException):
                    outcome = forwards[index].throw(value)
                else:
                    outcome = forwards[index].switch(value)
                if isinstance(outcome, _Waiting) and not forwards[index].dead:
                    waiting[index] = outcome
                else:
                    results[index] = outcome
            resume = {}
            if waiting:
                resume = _merged_call(waiting)
    except BaseException:
        for forward in forwards:
            if not forward.dead:
                forward.throw()  # GreenletExit: unwinds its stack, runs its finally blocks
        raise
    return results


def _merged_call(waiting: dict[int, _Waiting]) -> dict[int, object]:
    """Serve the forwards waiting at the lowest layer with one call; they resume with their
    own rows (or the call's error, raised inside each of them)."""
    first = min(waiting.values(), key=lambda w: w.layer)
    group = [i for i, w in waiting.items() if w.layer == first.layer and w.dispatcher is first.dispatcher]
    parts = [waiting.pop(i) for i in group]
    if len(parts) == 1:
        hidden, expert_ids = parts[0].hidden, parts[0].expert_ids
    else:
        hidden = mx.concatenate([p.hidden for p in parts])
        expert_ids = mx.concatenate([p.expert_ids for p in parts])
        if getattr(first.dispatcher, "needs_evaluated_inputs", True):
            mx.eval(hidden, expert_ids)  # of evaluated inputs: each forward settled before its own eval
    try:
        out = first.dispatcher.call_overlapped(first.layer, hidden, expert_ids)
    except Exception as error:  # noqa: BLE001 - raised again inside each forward of the call
        return {i: error for i in group}
    resume, start = {}, 0
    for i, part in zip(group, parts, strict=True):
        rows = part.hidden.shape[0]
        resume[i] = out[start : start + rows]
        start += rows
    return resume
