"""Expert streaming under a memory budget, in process: bit-identity, policies, damaged files."""

from __future__ import annotations

import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from services.common import tensor_codec
from services.common.manifest import Manifest
from services.experts.cache_policy import DecayedFrequencyPolicy, LRUPolicy, make_policy
from services.experts.compute import ExpertCompute
from services.experts.io import ExpertFileError
from services.experts.store import ResidentExpertStore
from services.experts.store_setup import open_store
from services.experts.streaming_store import BudgetTooSmall, StreamingExpertStore, expert_bytes
from services.proto.moemesh.v1 import expert_pb2


def all_experts(manifest: Manifest) -> dict[int, list[int]]:
    return {layer: list(range(manifest.num_experts)) for layer in manifest.layer_indices}


def random_calls(manifest: Manifest, count: int, seed: int = 0) -> list[expert_pb2.ExpertCall]:
    """Decode-shaped calls mostly, some partial (-1) and some prefill-wide ones."""
    rng = np.random.RandomState(seed)
    top_k, hidden = 2, manifest.hidden_size
    calls = []
    for i in range(count):
        tokens = [1, 1, 1, 2, 24][i % 5]
        ids = np.stack([rng.choice(manifest.num_experts, top_k, replace=False) for _ in range(tokens)])
        ids = ids.astype(np.int32)
        if i % 7 == 3:
            ids[0, 1] = -1
        layer = manifest.layer_indices[rng.randint(len(manifest.layer_indices))]
        x = mx.array(rng.normal(size=(tokens, hidden)).astype(np.float32)).astype(
            tensor_codec.MLX_DTYPE_BY_NAME[manifest.dtype]
        )
        calls.append(
            expert_pb2.ExpertCall(
                call_id=i,
                layer=layer,
                hidden=tensor_codec.encode(x),
                expert_ids=tensor_codec.encode(mx.array(ids)),
            )
        )
    return calls


@pytest.mark.parametrize(
    "arch,bits,io_mode,policy,min_segment_bytes",
    [
        ("qwen3_moe", 4, "buffered", "lru", 0),
        ("qwen3_moe", 4, "direct", "lfu-decay", 4096),  # sub-page tensors: staged, two segments
        ("mixtral", None, "direct", "lru", 4096),  # page-multiple tensors: read into the slots
        ("mixtral", None, "buffered", "lfu-decay", 8192),
        ("qwen3_5_moe", 4, "buffered", "lfu-decay", 1 << 20),
    ],
)
def test_budget_smaller_than_shard_gives_bit_identical_outputs(
    tiny_models, arch, bits, io_mode, policy, min_segment_bytes
):
    split = tiny_models.split(arch, bits)
    manifest = Manifest.load(split)
    owned = all_experts(manifest)
    resident = ExpertCompute(ResidentExpertStore(split, manifest, owned))
    # 3 experts of the 32 owned: decode calls mostly miss, wide calls run in several groups.
    budget = 3 * expert_bytes(manifest.layers[0])
    store = StreamingExpertStore(
        split, manifest, owned, budget, io_mode=io_mode, policy=policy, min_segment_bytes=min_segment_bytes
    )
    streaming = ExpertCompute(store)
    for call in random_calls(manifest, 60):
        expected = resident.run(call).output
        got = streaming.run(call).output
        assert got.data == expected.data, f"call {call.call_id} differs"
        assert list(got.shape) == list(expected.shape)
    stats = store.stats()
    assert stats.slots == 3 and stats.cached == 3
    assert stats.misses > 0 and stats.evictions == stats.misses - 3
    assert stats.hits + stats.misses >= 60
    assert stats.bytes_read >= stats.misses * expert_bytes(manifest.layers[0])
    assert stats.read_gbps > 0 and stats.resident_bytes <= budget
    store.close()


def test_hits_read_nothing_and_describe_counters_add_up(tiny_models):
    split = tiny_models.split("qwen3_moe", 4)
    manifest = Manifest.load(split)
    owned = {1: [0, 1, 2, 3]}
    store, budget = open_store(split, manifest, owned, memory_gb=2.5 * expert_bytes(manifest.layer(1)) / 1e9)
    assert isinstance(store, StreamingExpertStore) and budget > 0
    compute = ExpertCompute(store)
    call = random_calls(manifest, 1)[0]
    call.layer = 1
    call.expert_ids.CopyFrom(tensor_codec.encode(mx.array([[0, 1]], dtype=mx.int32)))
    first = compute.run(call).output.data
    read_after_first = store.stats().bytes_read
    assert compute.run(call).output.data == first  # served from the slots, nothing read
    stats = store.stats()
    assert (stats.hits, stats.misses, stats.bytes_read) == (2, 2, read_after_first)
    assert store.is_resident(1, 0) and not store.is_resident(1, 3)
    reply = expert_pb2.DescribeResponse()
    from services.experts.store_setup import describe_cache

    describe_cache(reply, stats)
    assert (reply.cache_hits, reply.cache_misses, reply.cache_slots) == (2, 2, 2)
    assert (reply.io_mode, reply.cache_policy) == ("direct", "lfu-decay")  # the measured defaults
    store.close()


def test_budget_that_holds_the_shard_loads_everything(tiny_models):
    split = tiny_models.split("qwen3_moe", 4)
    manifest = Manifest.load(split)
    store, budget = open_store(split, manifest, all_experts(manifest), memory_gb=10.0)
    assert isinstance(store, ResidentExpertStore) and budget == 10 * 10**9


def test_budget_below_one_expert_is_a_clear_error(tiny_models):
    split = tiny_models.split("qwen3_moe", 4)
    manifest = Manifest.load(split)
    with pytest.raises(BudgetTooSmall, match="holds no expert"):
        StreamingExpertStore(split, manifest, all_experts(manifest), 100)


@pytest.fixture
def damaged_split(tiny_models, tmp_path) -> Path:
    """A private copy of a split that a test may truncate."""
    copy = tmp_path / "split"
    shutil.copytree(tiny_models.split("qwen3_moe", 4), copy)
    return copy


def test_truncated_layer_file_is_refused_at_start_naming_the_file(damaged_split):
    manifest = Manifest.load(damaged_split)
    path = damaged_split / manifest.layer(2).file
    with open(path, "r+b") as f:
        f.truncate(manifest.layer(2).record_size * 5)
    with pytest.raises(ExpertFileError, match=r"layer_002\.bin: .* manifest says .*truncated"):
        StreamingExpertStore(damaged_split, manifest, all_experts(manifest), 10**5)


def test_file_truncated_while_serving_fails_only_that_call(damaged_split):
    manifest = Manifest.load(damaged_split)
    layer = manifest.layer(2)
    store = StreamingExpertStore(damaged_split, manifest, {2: list(range(8))}, 4 * expert_bytes(layer))
    compute = ExpertCompute(store)
    reference = ExpertCompute(ResidentExpertStore(damaged_split, manifest, {2: list(range(8))}))
    with open(damaged_split / layer.file, "r+b") as f:
        f.truncate(layer.record_size * 6)  # experts 6 and 7 are gone
    call = random_calls(manifest, 1)[0]
    call.layer = 2
    call.expert_ids.CopyFrom(tensor_codec.encode(mx.array([[1, 7]], dtype=mx.int32)))
    with pytest.raises(ExpertFileError, match=r"layer_002\.bin: short read of expert 7 of layer 2"):
        compute.run(call)
    assert not store.is_resident(2, 7)  # the failed slot holds nothing a later call could use
    assert store.stats().read_failures == 1
    call.expert_ids.CopyFrom(tensor_codec.encode(mx.array([[1, 5]], dtype=mx.int32)))
    assert compute.run(call).output.data == reference.run(call).output.data
    store.close()


def test_lru_evicts_least_recent_and_never_a_pinned_key():
    policy = LRUPolicy()
    for key in "abc":
        policy.touch(key)
    policy.touch("a")
    assert policy.victim(set()) == "b"
    assert policy.victim({"b"}) == "c"
    with pytest.raises(LookupError):
        policy.victim({"a", "b", "c"})


def test_decayed_frequency_keeps_the_popular_and_forgets_the_old():
    policy = DecayedFrequencyPolicy(half_life_accesses=8)
    for _ in range(5):
        policy.touch("popular")
    policy.touch("once")
    assert policy.victim(set()) == "once"  # LRU would evict "popular" here
    assert policy.victim({"once"}) == "popular"
    policy.forget("once")
    for _ in range(40):  # "popular" is not touched for 5 half-lives
        policy.touch("new")
        policy.touch("newer")
    assert policy.victim(set()) == "popular"
    with pytest.raises(ValueError):
        make_policy("fifo")


def test_metrics_count_what_the_store_did(tiny_models):
    from prometheus_client import CollectorRegistry

    from services.experts.metrics import ExpertCacheMetrics

    split = tiny_models.split("qwen3_moe", 4)
    manifest = Manifest.load(split)
    registry = CollectorRegistry()
    store = StreamingExpertStore(
        split,
        manifest,
        {0: list(range(8))},
        2 * expert_bytes(manifest.layer(0)),
        metrics=ExpertCacheMetrics(registry),
    )
    for group in ([0, 1], [1, 2], [3]):
        store.load(0, group)
    stats = store.stats()
    sample = registry.get_sample_value
    assert (stats.hits, stats.misses, stats.evictions) == (1, 4, 2)
    assert sample("moe_mesh_expert_cache_hits_total") == 1
    assert sample("moe_mesh_expert_cache_misses_total") == 4
    assert sample("moe_mesh_expert_cache_evictions_total") == 2
    assert sample("moe_mesh_expert_read_bytes_total") == stats.bytes_read > 0
    assert sample("moe_mesh_expert_read_seconds_total") == pytest.approx(stats.read_seconds)
    store.close()


def test_filesystem_without_direct_io_falls_back_to_the_page_cache(tiny_models, monkeypatch):
    import errno
    import os

    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    split = tiny_models.split("qwen3_moe", 4)
    manifest = Manifest.load(split)
    owned = all_experts(manifest)
    store = StreamingExpertStore(
        split, manifest, owned, 3 * expert_bytes(manifest.layers[0]), io_mode="direct"
    )
    assert store.stats().io_mode == "buffered"
    resident = ExpertCompute(ResidentExpertStore(split, manifest, owned))
    streaming = ExpertCompute(store)
    for call in random_calls(manifest, 10, seed=3):
        assert streaming.run(call).output.data == resident.run(call).output.data
    store.close()
