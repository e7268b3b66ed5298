"""How `moe-mesh up` places experts on its workers, with and without replicas."""

from __future__ import annotations

from collections import Counter

import pytest

from services.common.ranges import parse_ranges
from services.ops.up import expert_ranges


@pytest.mark.parametrize(
    ("experts", "workers", "replicas"), [(8, 2, 1), (8, 3, 2), (128, 4, 2), (8, 3, 3), (60, 7, 2)]
)
def test_every_expert_lives_on_exactly_replicas_workers(experts, workers, replicas):
    ranges = expert_ranges(experts, workers, replicas)
    assert len(ranges) == workers
    held = Counter(e for text in ranges for e in parse_ranges(text, experts, "experts"))
    assert held == {e: replicas for e in range(experts)}
    # no two workers hold the same set (losing one never takes its twin with it)
    assert len(set(ranges)) == workers or replicas == workers


def test_replicas_beyond_the_workers_are_refused():
    with pytest.raises(SystemExit, match="--replicas must be between 1 and --experts"):
        expert_ranges(8, 2, 3)
