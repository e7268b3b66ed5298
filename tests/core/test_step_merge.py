"""step_merge: the forwards of one engine step share one expert call per layer, and each gets
exactly the rows it would have got calling alone."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from services.core.expert_link.step_merge import expert_call, run_side_by_side

LAYERS = 4


class RecordingDispatcher:
    """Stands in for ExpertDispatcher: out[t, j] = hidden[t] * (ids[t, j] + 1) + layer."""

    def __init__(self, fail_at_layer: int | None = None):
        self.calls: list[tuple[int, int]] = []  # (layer, tokens)
        self.fail_at_layer = fail_at_layer

    def call(self, layer: int, hidden: mx.array, expert_ids: mx.array) -> mx.array:
        self.calls.append((layer, hidden.shape[0]))
        if layer == self.fail_at_layer:
            raise RuntimeError(f"worker down at layer {layer}")
        scale = (expert_ids + 1).astype(hidden.dtype)[..., None]
        return hidden[:, None, :] * scale + layer

    call_overlapped = call  # what the model's forward uses; this stand-in answers at once


def forward(dispatcher, tokens: int, seed: int, unwound: list | None = None):
    """A toy model forward: each layer routes every token to 2 experts and sums their outputs."""

    def run():
        try:
            x = mx.random.normal((tokens, 8), key=mx.random.key(seed))
            for layer in range(LAYERS):
                ids = (mx.arange(tokens * 2).reshape(tokens, 2) + seed + layer) % 5
                ids = ids.astype(mx.int32)
                mx.eval(x, ids)
                x = expert_call(dispatcher, layer, x, ids).sum(axis=1) / 3
            return np.array(x)
        finally:
            if unwound is not None:
                unwound.append(seed)

    return run


def test_forwards_share_one_call_per_layer_and_get_their_own_rows():
    alone = RecordingDispatcher()
    expected = [forward(alone, tokens, seed)() for seed, tokens in enumerate((1, 7, 3))]
    assert len(alone.calls) == 3 * LAYERS

    merged = RecordingDispatcher()
    got = run_side_by_side([forward(merged, tokens, seed) for seed, tokens in enumerate((1, 7, 3))])
    assert merged.calls == [(layer, 1 + 7 + 3) for layer in range(LAYERS)]
    for mine, reference in zip(got, expected, strict=True):
        np.testing.assert_array_equal(mine, reference)


def test_a_forward_that_makes_no_calls_or_ends_early_does_not_block_the_others():
    dispatcher = RecordingDispatcher()

    def short():
        x = mx.ones((2, 8))
        ids = mx.zeros((2, 2), dtype=mx.int32)
        return np.array(expert_call(dispatcher, 0, x, ids))

    got = run_side_by_side([lambda: "no forward", short, forward(dispatcher, 4, 1)])
    assert got[0] == "no forward"
    assert got[1].shape == (2, 2, 8)
    assert dispatcher.calls == [(0, 6)] + [(layer, 4) for layer in range(1, LAYERS)]


def test_a_failed_call_raises_once_and_unwinds_every_forward():
    dispatcher = RecordingDispatcher(fail_at_layer=2)
    unwound: list[int] = []
    with pytest.raises(RuntimeError, match="worker down at layer 2"):
        run_side_by_side([forward(dispatcher, 2, seed, unwound) for seed in range(3)])
    assert sorted(unwound) == [0, 1, 2]
    assert dispatcher.calls == [(0, 6), (1, 6), (2, 6)]


def test_outside_a_step_the_call_goes_straight_to_the_dispatcher():
    dispatcher = RecordingDispatcher()
    forward(dispatcher, 3, 0)()
    assert dispatcher.calls == [(layer, 3) for layer in range(LAYERS)]
    assert run_side_by_side([forward(dispatcher, 1, 0)])[0].shape == (1, 8)
