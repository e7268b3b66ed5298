"""Metal kernels against the pure-MLX twin. Needs an Apple GPU: elsewhere mx.fast.metal_kernel
cannot run at all, so the comparison is skipped (the twin itself is tested everywhere)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from metal import kernels

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
        (DecodeWithoutSinks(), decode_matches, "decode"),
        (DecodeNotServed(), decode_matches, "decode"),
    ):
        failures = []
        assert not check(broken, 0, failures)
        assert failures and all(f.startswith(what) for f in failures), (type(broken).__name__, failures)
