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

START = object()  # what a forward that has not run yet is resumed with


class Forward(greenlet):
    """A greenlet whose expert calls go to the step's hub instead of straight out."""


@dataclass
class Waiting:
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
    if isinstance(current, Forward):
        return current.parent.switch(Waiting(dispatcher, layer, hidden, expert_ids))
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
    forwards = [Forward(task) for task in tasks]
    results: list = [None] * len(tasks)
    resume: dict[int, object] = {index: START for index in range(len(tasks))}  # index -> value to send
    waiting: dict[int, Waiting] = {}
    try:
        while resume:
            for index, value in resume.items():
                outcome = resume_forward(forwards[index], value)
                if isinstance(outcome, Waiting) and not forwards[index].dead:
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


def resume_forward(forward: Forward, value) -> object:
    """Run `forward` until it waits at an expert call (returns that `Waiting`) or ends (returns
    its result); `value` is START, the rows it waited for, or the error to raise inside it."""
    if value is START:
        return forward.switch()
    if isinstance(value, BaseException):
        return forward.throw(value)
    return forward.switch(value)


def _merged_call(waiting: dict[int, Waiting]) -> dict[int, object]:
    """Serve the forwards waiting at the lowest layer with one call; they resume with their
    own rows (or the call's error, raised inside each of them)."""
    group, parts = take_lowest_layer(waiting)
    first = parts[0]
    hidden, expert_ids = merged_inputs(parts)
    try:
        out = first.dispatcher.call_overlapped(first.layer, hidden, expert_ids)
    except Exception as error:  # noqa: BLE001 - raised again inside each forward of the call
        out = error
    return split_answer(group, parts, out)


def take_lowest_layer(waiting: dict[int, Waiting]) -> tuple[list[int], list[Waiting]]:
    """Remove from `waiting` the forwards that wait at its lowest layer on one dispatcher."""
    first = min(waiting.values(), key=lambda w: w.layer)
    group = [i for i, w in waiting.items() if w.layer == first.layer and w.dispatcher is first.dispatcher]
    return group, [waiting.pop(i) for i in group]


def merged_inputs(parts: list[Waiting]) -> tuple[mx.array, mx.array]:
    """One call's hidden states and expert ids: every part's, in order."""
    if len(parts) == 1:
        return parts[0].hidden, parts[0].expert_ids
    hidden = mx.concatenate([p.hidden for p in parts])
    expert_ids = mx.concatenate([p.expert_ids for p in parts])
    if getattr(parts[0].dispatcher, "needs_evaluated_inputs", True):
        mx.eval(hidden, expert_ids)  # of evaluated inputs: each forward settled before its own eval
    return hidden, expert_ids


def split_answer(group: list[int], parts: list[Waiting], out) -> dict[int, object]:
    """Each forward's rows of a merged call's answer (or the call's error, for each of them)."""
    if isinstance(out, BaseException):
        return {i: out for i in group}
    resume, start = {}, 0
    for i, part in zip(group, parts, strict=True):
        rows = part.hidden.shape[0]
        resume[i] = out[start : start + rows]
        start += rows
    return resume
