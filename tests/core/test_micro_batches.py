"""Micro-batches (step_merge with lanes): two lanes pipeline their layer calls (ping-pong) and
every forward still gets exactly the rows it would have got calling alone."""

from __future__ import annotations

import numpy as np
import pytest

from services.core.expert_link.step_merge import run_side_by_side
from tests.core.test_step_merge import LAYERS, RecordingDispatcher, forward


class PipeliningDispatcher(RecordingDispatcher):
    """RecordingDispatcher with ExpertDispatcher's send-now, read-later calls. `log` records
    sends and reads in order; `queues` is what `queues_behind` answers."""

    def __init__(self, fail_at_layer: int | None = None, queues: bool = True):
        super().__init__(fail_at_layer)
        self.log: list[tuple[str, int, int]] = []  # (send | read | abandon, layer, tokens)
        self.queues = queues
        self.unread = 0

    def start_call(self, layer, hidden, expert_ids):
        self.log.append(("send", layer, hidden.shape[0]))
        self.unread += 1
        try:
            answer = self.call(layer, hidden, expert_ids)
        except RuntimeError as error:
            answer = error
        return (layer, hidden.shape[0], answer)

    def finish(self, pending):
        layer, tokens, answer = pending
        self.unread -= 1
        self.log.append(("read", layer, tokens))
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def abandon(self, pending):
        self.unread -= 1
        self.log.append(("abandon", pending[0], pending[1]))

    def queues_behind(self, earlier, nbytes):
        return self.queues


SHAPES = ((1, 0), (3, 0), (2, 1), (4, 1))  # (tokens, lane) of four forwards


def test_lanes_send_behind_each_other_and_every_forward_gets_its_own_rows():
    alone = RecordingDispatcher()
    expected = [forward(alone, tokens, seed)() for seed, (tokens, _) in enumerate(SHAPES)]

    dispatcher = PipeliningDispatcher()
    tasks = [forward(dispatcher, tokens, seed) for seed, (tokens, _) in enumerate(SHAPES)]
    got = run_side_by_side(tasks, [lane for _, lane in SHAPES])
    for mine, reference in zip(got, expected, strict=True):
        np.testing.assert_array_equal(mine, reference)
    # Lane 0 carries 1 + 3 tokens, lane 1 2 + 4. Each call goes out before the other lane's
    # answer is read: while one lane's experts compute, the other lane runs.
    pingpong = [("send", 0, 4), ("send", 0, 6)]
    for layer in range(1, LAYERS):
        pingpong += [("read", layer - 1, 4), ("send", layer, 4), ("read", layer - 1, 6), ("send", layer, 6)]
    pingpong += [("read", LAYERS - 1, 4), ("read", LAYERS - 1, 6)]
    assert dispatcher.log == pingpong
    assert dispatcher.unread == 0


def test_where_a_call_cannot_queue_the_earlier_answer_is_read_first():
    dispatcher = PipeliningDispatcher(queues=False)
    run_side_by_side([forward(dispatcher, 2, 0), forward(dispatcher, 3, 1)], [0, 1])
    assert [entry[0] for entry in dispatcher.log] == ["send", "read"] * LAYERS * 2


def test_a_dispatcher_without_start_call_answers_each_call_at_once():
    dispatcher = RecordingDispatcher()
    alone = [forward(RecordingDispatcher(), tokens, seed)() for seed, tokens in enumerate((2, 5))]
    got = run_side_by_side([forward(dispatcher, 2, 0), forward(dispatcher, 5, 1)], [0, 1])
    for mine, reference in zip(got, alone, strict=True):
        np.testing.assert_array_equal(mine, reference)
    assert dispatcher.calls == [(layer, tokens) for layer in range(LAYERS) for tokens in (2, 5)]


def test_one_lane_merges_as_before():
    dispatcher = PipeliningDispatcher()
    run_side_by_side([forward(dispatcher, 2, 0), forward(dispatcher, 3, 1)], [1, 1])
    assert dispatcher.calls == [(layer, 5) for layer in range(LAYERS)]
    assert dispatcher.log == []  # merged calls take the plain path


def test_a_failed_call_unwinds_both_lanes_and_leaves_no_answer_unread():
    dispatcher = PipeliningDispatcher(fail_at_layer=2)
    unwound: list[int] = []
    tasks = [forward(dispatcher, 2, seed, unwound) for seed in range(4)]
    with pytest.raises(RuntimeError, match="worker down at layer 2"):
        run_side_by_side(tasks, [0, 0, 1, 1])
    assert sorted(unwound) == [0, 1, 2, 3]
    assert dispatcher.unread == 0
    assert ("abandon", 2, 4) in dispatcher.log  # the other lane's call in flight was dropped
