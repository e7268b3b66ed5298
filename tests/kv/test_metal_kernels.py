"""Metal kernels against the pure-MLX twin. Needs an Apple GPU: elsewhere mx.fast.metal_kernel
cannot run at all, so the comparison is skipped (the twin itself is tested everywhere)."""

from __future__ import annotations

import shutil
import subprocess

import mlx.core as mx
import pytest

from metal import backend, kernels

needs_metal = pytest.mark.skipif(not mx.metal.is_available(), reason="Metal kernels need an Apple GPU")


def test_kernel_sources_have_every_section():
    sections = kernels._sections()
    assert {"header", "pack", "scores", "values"} <= set(sections)
    assert "tq_index" in sections["header"]


def test_kernels_are_never_used_without_metal():
    assert kernels.kernels_available() == (mx.metal.is_available() and kernels.kernels_match_twin())


@needs_metal
def test_kernels_match_the_twin():
    assert kernels.kernels_match_twin(seed=0)
    assert kernels.kernels_match_twin(seed=1)


# ---- the self-check every GPU backend passes first (metal/selfcheck.py), run on the twin ----


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
    from metal.selfcheck import backend_matches_twin, codec_kernels_match, decode_matches

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


# ---- the Metal source at least parses (no Metal compiler here): C++ with Metal's names mocked ----

_METAL_AS_CPP = """#include <cmath>
#include <cstdint>
#include <algorithm>
#define device
#define threadgroup
#define constant const
using uint = unsigned; using ulong = unsigned long; using half = float;
struct uint3 { uint x, y, z; };
enum class mem_flags { mem_threadgroup };
inline void threadgroup_barrier(mem_flags) {}
inline float simd_max(float v) { return v; }
inline float simd_sum(float v) { return v; }
namespace metal { using std::exp; }
using std::max; using std::min;
"""
# input type letters as in test_cuda_kernels (f float, h half, b uint8, i int32)
_METAL_TYPES = {"f": "float", "h": "half", "b": "uint8_t", "i": "int32_t"}
_ATTRIBUTES = ("thread_position_in_grid", "thread_position_in_threadgroup", "threadgroup_position_in_grid")


def metal_as_cpp(sections: dict[str, str]) -> str:
    from tests.kv.test_cuda_kernels import _CALLS

    out = [_METAL_AS_CPP, sections["header"]]
    for name, (inputs, outputs, _) in backend.KERNELS.items():
        in_types, out_types, template = _CALLS[name]
        body, params = sections[name], []
        for input_name, kind in zip(inputs, in_types, strict=True):
            params.append(f"const {_METAL_TYPES[kind]}* {input_name}")
            if input_name + "_shape" in body:
                params.append(f"const int* {input_name}_shape")
            if input_name + "_strides" in body:
                params.append(f"const int64_t* {input_name}_strides")
        params += [f"{_METAL_TYPES[kind]}* {n}" for n, kind in zip(outputs, out_types, strict=True)]
        params += [f"uint3 {a}" for a in (*_ATTRIBUTES, "threadgroups_per_grid") if a in body]
        constants = [
            f"using {k} = {'half' if v == '__half' else v};"
            if isinstance(v, str)
            else f"constexpr int {k} = {v};"
            for k, v in template.items()
        ]
        out.append(f"void turboquant_{name}({', '.join(params)}) {{")
        out += constants + [body, "}"]
    return "\n".join(out)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_every_metal_kernel_parses_with_metal_names_mocked(tmp_path):
    source = tmp_path / "turboquant_metal.cpp"
    source.write_text(metal_as_cpp(kernels._sections()))
    result = subprocess.run(
        ["g++", "-std=c++17", "-fsyntax-only", "-Wno-unused", str(source)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
