"""The prefill chunk is cut to a step-time target: beside decoding streams `--max-step-seconds`,
alone a multiple of it in big chunks."""

from __future__ import annotations

from services.core.prefill_pacer import ALONE_FACTOR, ALONE_MIN_TOKENS, MIN_TOKENS, PROBE_TOKENS, PrefillPacer


def test_a_prompt_alone_gets_a_longer_target_in_big_chunks():
    pacer = PrefillPacer(target_s=1.0)
    # the first chunk alone, before its cost is known: one chunk of the minimum size, not the
    # whole budget (on a slow CPU that one step would take tens of seconds)
    assert pacer.budget(512, decoding=0) == ALONE_MIN_TOKENS
    pacer.observe(seconds=0.05 * 64, prefill_tokens=64, decoding=0)  # 50 ms a token
    assert pacer.alone_token_s == 0.05 and pacer.token_s is None  # beside decoding: still unknown
    assert pacer.budget(512, decoding=0) == int(ALONE_FACTOR * 1.0 / 0.05) // 8 * 8  # 80 tokens
    slow = PrefillPacer(target_s=1.0)
    slow.observe(seconds=30.0, prefill_tokens=64, decoding=0)
    assert slow.budget(512, decoding=0) == ALONE_MIN_TOKENS  # never smaller chunks than this
    assert slow.budget(40, decoding=0) == 40  # a short prompt in one step
    fast = PrefillPacer(target_s=1.0)  # a GPU: the token budget binds
    fast.observe(seconds=0.03, prefill_tokens=64, decoding=0)
    assert fast.budget(512, decoding=0) == 512
    fast.observe(seconds=0.0, prefill_tokens=512, decoding=0)
    fast.observe(seconds=0.0, prefill_tokens=512, decoding=0)
    assert fast.budget(512, decoding=0) == 512  # no division by a zero cost


def test_beside_decoding_streams_the_chunk_fits_the_target():
    pacer = PrefillPacer(target_s=1.0)
    assert pacer.budget(511, decoding=1) == PROBE_TOKENS  # nothing known yet: a small probe
    pacer.observe(seconds=0.2, prefill_tokens=0, decoding=1)  # a decode-only step
    pacer.observe(seconds=0.2 + 32 * 0.07, prefill_tokens=32, decoding=1)  # 70 ms a prompt token
    assert pacer.budget(511, decoding=1) == int((1.0 - 0.2) / 0.07) // 8 * 8  # multiples of 8
    # where tokens are cheap (a GPU), the token budget is what binds
    fast = PrefillPacer(target_s=1.0)
    fast.observe(seconds=0.02, prefill_tokens=0, decoding=1)
    fast.observe(seconds=0.02 + 511 * 1e-4, prefill_tokens=511, decoding=1)
    assert fast.budget(511, decoding=1) == 511 // 8 * 8
    fast.observe(seconds=0.0, prefill_tokens=511, decoding=1)  # a step faster than the estimate
    assert fast.budget(511, decoding=1) == 504  # no division by a zero cost


def test_a_prompt_always_moves_on_and_the_estimates_follow_the_machine():
    pacer = PrefillPacer(target_s=0.5)
    pacer.observe(seconds=2.0, prefill_tokens=0, decoding=4)  # decoding alone is over the target
    pacer.observe(seconds=3.0, prefill_tokens=10, decoding=4)
    assert pacer.budget(508, decoding=4) == MIN_TOKENS
    for _ in range(20):  # the machine got faster (load went away)
        pacer.observe(seconds=0.1, prefill_tokens=0, decoding=4)
        pacer.observe(seconds=0.1 + 100 * 1e-3, prefill_tokens=100, decoding=4)
    assert 300 <= pacer.budget(508, decoding=4) <= 400 and pacer.budget(508, decoding=4) % MIN_TOKENS == 0


def test_no_target_means_tokens_only():
    pacer = PrefillPacer(target_s=0)
    pacer.observe(seconds=30.0, prefill_tokens=32, decoding=1)
    pacer.observe(seconds=30.0, prefill_tokens=32, decoding=0)
    assert pacer.budget(511, decoding=1) == 511
    assert pacer.budget(512, decoding=0) == 512
