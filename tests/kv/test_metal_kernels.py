"""Metal kernels against the pure-MLX twin. On an Apple GPU through mx.fast.metal_kernel; everywhere
else the same source runs on the CPU through tests/kv/metal_emulator.py (its logic, not Apple's
compiler or its speed), and the twin itself is tested everywhere."""

from __future__ import annotations

import mlx.core as mx
import pytest

from metal import backend, kernels
from services.core.kv.kernel_check import backend_matches_twin, kernels_pass
from tests.kv import metal_emulator

pytestmark = pytest.mark.slow  # starts processes or computes for seconds

needs_metal = pytest.mark.skipif(not mx.metal.is_available(), reason="Metal kernels need an Apple GPU")


def test_kernel_sources_have_every_section():
    sections = kernels._sections()
    assert {"header", "pack", "scores", "values"} <= set(sections)
    assert "tq_index" in sections["header"]


def test_kernels_are_never_used_without_metal():
    assert kernels_pass(kernels) == (mx.metal.is_available() and backend_matches_twin(kernels))


@needs_metal
def test_kernels_match_the_twin():
    assert backend_matches_twin(kernels, seed=0)
    assert backend_matches_twin(kernels, seed=1)


# ---- the self-check every GPU backend passes first (services/core/kv/kernel_check.py), on the twin ----


class TwinBackend:
    """The twin itself behind the backend contracts: what a correct kernel set computes."""

    def pack(self, codec, x):
        tokens = codec.encode(x)
        return tokens.norm, tokens.codes, tokens.residual_norm, tokens.qjl_signs

    def key_scores(self, codec, rotated_queries, tokens):
        return codec.key_scores(rotated_queries, tokens)

    def weighted_values(self, codec, weights, tokens):
        return (weights * tokens.norm.astype(mx.float32)[..., None, :]) @ codec.centroid_values(tokens)

    def decode_attention(self, queries, cache, scale, start):
        from services.core.kv.decode_attention import decode_attention

        return decode_attention(queries, cache, scale)

    def decoded_run(self, key_codec, value_codec, keys, values, dtype):
        estimated = key_codec.estimated_keys(keys, dtype)
        return estimated, value_codec.decode_rotated(values).astype(dtype)


class InvertedSigns(TwinBackend):
    def pack(self, codec, x):
        norm, codes, residual_norm, signs = super().pack(codec, x)
        return norm, codes, residual_norm, None if signs is None else ~signs


class ValuesMissLastToken(TwinBackend):
    def weighted_values(self, codec, weights, tokens):
        return super().weighted_values(codec, weights[..., :-1], tokens.tokens(0, tokens.length - 1))


class DecodeWithoutSinks(TwinBackend):
    def decode_attention(self, queries, cache, scale, start):
        from copy import copy

        without = copy(cache)
        without.sink_keys = without.sink_values = None
        without.offset -= cache.sink_keys.shape[2]
        return super().decode_attention(queries, without, scale, start)


class RunWithoutQJL(TwinBackend):
    def decoded_run(self, key_codec, value_codec, keys, values, dtype):
        _, decoded = super().decoded_run(key_codec, value_codec, keys, values, dtype)
        mse_only = key_codec.decode_rotated(keys).astype(dtype)  # the QJL term forgotten
        return mse_only, decoded


class DecodeNotServed(TwinBackend):
    def decode_attention(self, queries, cache, scale, start):
        return None


def test_the_self_check_accepts_the_twin_and_names_what_a_wrong_kernel_breaks():
    from services.core.kv.kernel_check import backend_matches_twin, codec_kernels_match, decode_matches

    failures = []
    assert backend_matches_twin(TwinBackend(), seed=0, failures=failures), failures
    for broken, check, what in (
        (InvertedSigns(), codec_kernels_match, "pack"),
        (ValuesMissLastToken(), codec_kernels_match, "weighted_values"),
        (RunWithoutQJL(), codec_kernels_match, "decoded_run"),
        (DecodeWithoutSinks(), decode_matches, "decode"),
        (DecodeNotServed(), decode_matches, "decode"),
    ):
        failures = []
        assert not check(broken, 0, failures)
        assert failures and all(f.startswith(what) for f in failures), (type(broken).__name__, failures)


# ---- the Metal source run on this CPU (tests/kv/metal_emulator.py) ----------------------------

needs_emulator = pytest.mark.skipif(
    not metal_emulator.available(), reason="running Metal sources on the CPU needs a C++20 compiler"
)


def emulated_backend(source=kernels.SOURCE) -> backend.KernelBackend:
    """metal/backend.py's own dispatch of `source`, every kernel run by the CPU emulator."""
    return backend.KernelBackend(source, metal_emulator.metal_kernel, shared_limit=32 * 1024)


@needs_emulator
def test_the_metal_source_matches_the_twin_when_run_on_the_cpu():
    """What a Mac's start-up self-check runs (services/core/kv/kernel_check.py), on metal/turboquant.metal
    itself: its arithmetic, bit layout, barriers and SIMD-group reductions, not Apple's
    compiler or its speed."""
    for seed in (0, 1):
        failures = []
        assert backend_matches_twin(emulated_backend(), seed, failures), failures


@needs_emulator
def test_the_emulated_self_check_fails_a_broken_metal_kernel(tmp_path):
    from services.core.kv.kernel_check import decode_matches

    source = kernels.SOURCE.read_text()
    correct = "qjl[r] += up ? qp_s[r * P + j] : -qp_s[r * P + j];"
    assert source.count(correct) == 1
    broken = tmp_path / "turboquant.metal"
    broken.write_text(source.replace(correct, "qjl[r] += up ? -qp_s[r * P + j] : qp_s[r * P + j];"))
    failures = []
    assert not decode_matches(emulated_backend(broken), 0, failures)
    assert failures and all(f.startswith("decode") for f in failures)


@needs_emulator
def test_the_emulator_runs_threadgroups_as_metal_does():
    """Threadgroup memory shared by a group and not between groups, barriers, simd_sum over
    32 lanes, a smaller last group, strided views where contiguity is not asked, bfloat16."""
    body = """
    uint i = thread_position_in_grid.x;
    uint j = thread_position_in_threadgroup.x;
    threadgroup float shared[64];
    shared[j] = float(x[i * x_strides[0]]);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    sums[i] = simd_sum(shared[j]);
    neighbour[i] = static_cast<T>(shared[(j + 1) % threads_per_threadgroup.x]);
    stride[i] = int(x_strides[0]);
    """
    kernel = metal_emulator.metal_kernel(
        "t", ["x"], ["sums", "neighbour", "stride"], body, ensure_row_contiguous=False
    )
    base = mx.arange(200).astype(mx.bfloat16)
    x = base[::2]  # 100 elements: groups of 64 and 36, simd groups of 32, 32, 32, 4
    sums, neighbour, stride = kernel(
        inputs=[x],
        template=[("T", mx.bfloat16)],
        grid=(100, 1, 1),
        threadgroup=(64, 1, 1),
        output_shapes=[(100,), (100,), (100,)],
        output_dtypes=[mx.float32, mx.bfloat16, mx.int32],
    )
    values = x.astype(mx.float32)
    lane_sums = [
        values[a : min(a + 32, b)].sum().item() for a, b in ((0, 64), (32, 64), (64, 100), (96, 100))
    ]
    expected = [lane_sums[min(i // 32, 3)] for i in range(100)]
    assert sums.tolist() == pytest.approx(expected)
    rolled = [values[(i // 64) * 64 + (i % 64 + 1) % (64 if i < 64 else 36)].item() for i in range(100)]
    assert stride.tolist() == [2] * 100  # the view itself, not a copy
    assert neighbour.dtype == mx.bfloat16 and neighbour.astype(mx.float32).tolist() == rolled
