"""The prefill chunk beside decoding streams is cut to a step-time target; alone, a prompt takes
the whole token budget."""

from __future__ import annotations

from services.core.prefill_pacer import MIN_TOKENS, PROBE_TOKENS, PrefillPacer


def test_with_nothing_decoding_the_whole_budget_goes_to_prefill():
    pacer = PrefillPacer(target_s=1.0)
    pacer.observe(seconds=30.0, prefill_tokens=512, decoding=0)  # slow, but nobody waited
    assert pacer.budget(512, decoding=0) == 512
    assert pacer.token_s is None  # a prompt alone teaches nothing: the step's fixed cost is in it


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
    assert pacer.budget(511, decoding=1) == 511
