"""The dispatcher's shortcut for a layer that one worker holds whole (no sockets)."""

from __future__ import annotations

import pytest

from services.common.manifest import Manifest
from services.core.expert_link.dispatcher import ExpertDispatcher
from tests.helpers import fake_link


@pytest.fixture
def dispatcher(tiny_models):
    manifest = Manifest.load(tiny_models.split("qwen3_moe", None))
    dispatcher = ExpertDispatcher(manifest, ["unix:/nonexistent.sock"])
    yield dispatcher
    dispatcher.links = []
    dispatcher.close()


def test_only_a_layer_held_whole_by_one_live_worker_skips_routing(dispatcher):
    first, *rest = dispatcher.manifest.layer_indices
    everything = list(range(dispatcher.manifest.num_experts))
    dispatcher.links = [
        fake_link([first], everything),
        fake_link(rest, everything[:4]),
        fake_link(rest, everything[4:]),
    ]
    dispatcher._rebuild_routes()
    assert dispatcher._sole_owner == {first: 0}  # the other layers are split over two workers

    dispatcher.links.append(fake_link([first], everything))  # a replica: calls must spread again
    dispatcher._rebuild_routes()
    assert first not in dispatcher._sole_owner

    dispatcher.links[0].up = False  # the replica is now the only live holder
    dispatcher._rebuild_routes()
    assert dispatcher._sole_owner == {first: 3}

    dispatcher.links[3].up = False  # nobody: no shortcut, and the gap is named
    dispatcher._rebuild_routes()
    assert dispatcher._sole_owner == {}
    gaps = dispatcher.coverage_gaps()
    assert any(
        gap.startswith(f"layer {first} experts 0-{len(everything) - 1} have no reachable worker")
        for gap in gaps
    ), gaps
