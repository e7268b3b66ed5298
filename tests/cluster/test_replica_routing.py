"""How the dispatcher places pairs on replicas (no sockets): balance, exclusion, gaps, grouping."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from services.common.manifest import Manifest
from services.core.expert_link.dispatcher import ExpertCallError, ExpertDispatcher
from services.core.expert_link.routes import plan_parts
from tests.helpers import fake_link


@pytest.fixture
def dispatcher(tiny_models):
    manifest = Manifest.load(tiny_models.split("qwen3_moe", None))
    dispatcher = ExpertDispatcher(manifest, ["unix:/nonexistent.sock"])
    layers = manifest.layer_indices
    dispatcher.links = [
        fake_link(layers, [0, 1, 2, 3]),
        fake_link(layers, [4, 5, 6, 7]),
        fake_link(layers, list(range(8))),
    ]
    dispatcher._rebuild_routes()
    yield dispatcher
    dispatcher.links = []
    dispatcher.close()


def test_replicas_share_the_load(dispatcher):
    ids = np.tile(np.arange(8, dtype=np.int32), (16, 1))[:, :2]  # experts 0 and 1 on every token
    counts = np.zeros(3)
    for rotation in range(10):
        owners = dispatcher._choose(0, ids, rotation)
        assert set(np.unique(owners).tolist()) <= {0, 2}  # 0 and 1 live on w0 and w2 only
        counts += np.bincount(owners.ravel(), minlength=3)
    assert counts[0] == counts[2]  # rotation splits them evenly over the calls


def test_failed_replica_is_excluded_and_a_lost_last_owner_is_named(dispatcher):
    ids = np.array([[0, 4], [3, 7]], dtype=np.int32)
    owners = dispatcher._choose(1, ids, rotation=0, exclude=(2,))
    assert owners.tolist() == [[0, 1], [0, 1]]
    dispatcher.links[1].up = False
    dispatcher._rebuild_routes()
    assert dispatcher._choose(1, ids, rotation=0, exclude=(0,)).tolist() == [[2, 2], [2, 2]]
    with pytest.raises(ExpertCallError) as error:
        dispatcher._choose(1, ids, rotation=0, exclude=(2,))
    assert error.value.code == grpc.StatusCode.UNAVAILABLE
    lost = dispatcher.links[1].address
    assert str(error.value) == f"layer 1 experts 4,7 have no reachable worker (last served by {lost})"
    assert dispatcher.coverage_gaps() == []  # w2 still holds everything
    dispatcher.links[1].last_describe.worker_id = "expert-1"
    dispatcher.links[1].last_error = "unreachable (UNAVAILABLE): connection refused"
    dispatcher.links[2].up = False
    dispatcher._rebuild_routes()
    # every layer lost the same experts: one line, naming the workers that held them and why
    layers = dispatcher.manifest.layer_indices
    assert dispatcher.coverage_gaps() == [
        f"layers {layers[0]}-{layers[-1]} experts 4-7 have no reachable worker (last served by "
        f"expert-1 at {dispatcher.links[1].address}: unreachable (UNAVAILABLE): connection refused; "
        f"{dispatcher.links[2].address})"
    ]


def test_plan_groups_pairs_by_worker_and_keeps_order():
    hidden = np.arange(3 * 4, dtype=np.float32).reshape(3, 4)
    ids = np.array([[0, 5], [1, 2], [6, 7]], dtype=np.int32)
    owners = np.array([[0, 1], [0, 0], [1, 1]])
    parts = {part.link: part for part in plan_parts(owners, hidden, ids)}
    assert parts[0].ids.tolist() == [[0, -1], [1, 2]] and parts[0].hidden.tolist() == hidden[:2].tolist()
    assert parts[1].ids.tolist() == [[-1, 5], [6, 7]] and parts[1].hidden.tolist() == hidden[[0, 2]].tolist()
    (single,) = plan_parts(np.zeros((3, 2), dtype=np.int32), hidden, ids)
    assert single.mask is None and single.ids is ids  # one worker: no copies
