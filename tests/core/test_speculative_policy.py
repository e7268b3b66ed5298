"""How many tokens a sequence drafts: acceptance and the measured cost of a drafted token decide."""

from __future__ import annotations

import pytest

from services.core.speculative.policy import PAUSE_STEPS, DraftPolicy, StepCosts, worth_drafting


def test_drafting_shortens_then_pauses_when_drafts_fail():
    policy = DraftPolicy(most=4)
    assert policy.budget() == 4
    policy.observe(4, 1)
    assert policy.budget() == 2
    for _ in range(3):
        policy.observe(2, 0)
    assert policy.paused and policy.budget() == 0
    while policy.paused:
        policy.budget()
    assert policy.budget() == 1
    policy.observe(1, 1)
    policy.observe(2, 2)
    assert policy.budget() == 3


def test_drafts_only_as_many_tokens_as_their_cost_pays_for():
    # a hop-bound step (a GPU, a network): a drafted token costs little, drafting pays even at low
    # acceptance; a compute-bound one: only well-accepted drafts pay, and poorly accepted never
    assert worth_drafting(0.3, linear(0.02).ratio, most=4) >= 1
    assert worth_drafting(0.9, linear(0.02).ratio, most=4) == 4
    assert worth_drafting(0.3, linear(0.6).ratio, most=4) == 0
    assert 1 <= worth_drafting(0.6, linear(0.25).ratio, most=4) < 4
    assert worth_drafting(1.0, linear(1.0).ratio, most=4) == 0  # a token per step at best: no gain
    policy = DraftPolicy(most=4, acceptance=0.3)
    assert policy.budget(linear(0.02)) >= 1
    assert policy.budget(linear(0.6)) == 0 and policy.paused  # not worth one draft: a pause
    while policy.paused:
        assert policy.budget(linear(0.6)) == 0
    assert policy.budget(linear(0.6)) == 1  # then one draft, to measure acceptance again
    policy.observe(1, 0)
    assert policy.budget(linear(0.6)) == 0 and policy.paused == 2 * PAUSE_STEPS - 1  # backs off
    while policy.paused:
        policy.budget(linear(0.6))
    assert policy.budget(linear(0.6)) == 1
    policy.observe(1, 1)
    policy.observe(1, 1)  # accepted again: drafting pays at a hop-bound step
    assert policy.budget(linear(0.02)) >= 1 and policy.pause_steps == PAUSE_STEPS


def test_a_drafted_token_too_dear_for_any_acceptance_stops_every_row_without_probes():
    policy = DraftPolicy(most=4)
    assert [policy.budget(linear(1.5)) for _ in range(40)] == [0] * 40
    assert not policy.paused  # StepCosts retries, not each row: a draft model's catch-up is dear


def linear(per_draft: float) -> StepCosts:
    """Step prices where each drafted token adds `per_draft` plain steps."""
    return StepCosts(fixed=per_draft)


class Steps:
    """Drives StepCosts as the decoder does, on a clock of our own."""

    def __init__(self, costs: StepCosts):
        self.costs, self.now, self.marked = costs, 0.0, False

    def run(self, drafted: int, seconds: float, count: int = 1) -> None:
        for _ in range(count):
            if not self.marked:
                self.costs.began(self.now)
            self.marked = False
            self.costs.chose(drafted)
            self.now += seconds

    def mark(self) -> None:
        """The next step begins now (what it is, `run` says)."""
        self.costs.began(self.now)
        self.marked = True


def test_a_drafted_token_is_priced_from_the_steps_own_times():
    costs = StepCosts()
    steps = Steps(costs)
    assert costs.wants_plain() and costs.per_draft is None
    steps.run(4, 0.3)  # no plain step measured yet: nothing to price against
    steps.run(0, 0.1, count=StepCosts.WARMUP_PLAIN)
    steps.mark()
    assert costs.plain_s == pytest.approx(0.1) and costs.per_draft is None and not costs.wants_plain()
    steps.run(4, 0.2)  # 4 drafted tokens doubled the step: each costs a quarter of one
    steps.mark()
    assert costs.per_draft == pytest.approx(0.25)
    steps.run(0, 0.1)
    costs.idle()  # the batch emptied: the time to the next step is not this one's
    steps.now += 30.0
    steps.marked = False
    steps.run(0, 0.1)
    steps.now += 30.0  # a gap in a running batch (another request's long prefill) is left out
    steps.mark()
    assert costs.plain_s == pytest.approx(0.1)
    steps.run(4, 0.2, count=StepCosts.REFRESH_STEPS)
    assert costs.wants_plain()  # now and then a plain step to price against
    steps.run(0, 0.1)
    steps.mark()
    assert not costs.wants_plain()


def test_each_draft_length_is_priced_on_its_own():
    """A verify step whose cost is mostly fixed: a one-token draft costs about what a four-token
    one does, so at low acceptance neither pays, where a price per drafted token fitted on the
    four-token steps would have drafted one token at a loss."""
    costs = StepCosts()
    steps = Steps(costs)
    steps.run(0, 0.1, count=StepCosts.WARMUP_PLAIN)
    steps.run(4, 0.18)
    steps.mark()
    assert costs.ratio(4) == pytest.approx(1.8) and costs.per_draft == pytest.approx(0.2)
    assert costs.ratio(1) == costs.ratio(3) == pytest.approx(1.8)  # not measured: priced dear
    assert costs.ratio(6) == pytest.approx(2.2)  # past the longest: in proportion to the draft
    chat, code = DraftPolicy(most=4, acceptance=0.36), DraftPolicy(most=4, acceptance=0.9)
    assert chat.budget(costs) == 0 and chat.paused
    assert code.budget(costs) == 4
    while chat.paused:
        chat.budget(costs)
    assert chat.budget(costs) == 1  # the probe, which prices a one-token step
    steps.run(1, 0.17)
    steps.mark()
    assert costs.ratio(1) == pytest.approx(1.7) and costs.ratio(2) == pytest.approx(1.8)
    assert DraftPolicy(most=4, acceptance=0.36).budget(costs) == 0  # measured dear too
    assert worth_drafting(0.36, linear(0.2).ratio, most=4) >= 1  # what one price per token said
    steps.run(1, 0.1, count=8)  # one-token steps turn cheap (say, fewer rows to verify)
    steps.mark()
    assert costs.ratio(1) < 1.1 and DraftPolicy(most=4, acceptance=0.36).budget(costs) == 1


def test_an_odd_interval_does_not_price_a_draft_length():
    """Another request's prefill merged into one drafting step, or a draft model catching up on a
    new prompt, leaves that length's price alone; the same dear interval twice in a row moves it."""
    costs = StepCosts()
    steps = Steps(costs)
    steps.run(0, 0.1, count=StepCosts.WARMUP_PLAIN)
    steps.run(4, 0.12)
    steps.run(4, 1.5)
    steps.mark()
    assert costs.ratio(4) == pytest.approx(1.2)
    steps.run(4, 0.12)
    steps.run(4, 1.5)
    steps.run(4, 1.5)
    steps.mark()
    assert costs.ratio(4) > 3.0


def test_lengths_not_timed_between_plain_steps_are_priced_again():
    """A length priced dear once would never be chosen to be timed again: the refresh plain step
    forgets it, and it is priced from the lengths timed since."""
    costs = StepCosts()
    steps = Steps(costs)
    steps.run(0, 0.1, count=StepCosts.WARMUP_PLAIN)
    steps.run(4, 0.5)
    steps.run(0, 0.1)  # a step every row decoded plainly (paused after that dear one)
    steps.run(1, 0.11, count=StepCosts.REFRESH_STEPS)
    steps.mark()
    assert costs.ratio(4) == pytest.approx(5.0) and costs.wants_plain()
    steps.run(0, 0.1)
    steps.mark()
    assert 4 not in costs.ratios and costs.ratio(4) == pytest.approx(1.4)
    assert costs.ratio(1) == pytest.approx(1.1)


def test_drafting_too_dear_to_pay_stops_then_is_priced_again_less_often():
    costs = StepCosts()
    steps = Steps(costs)

    def plain_steps_until_priced_again() -> int:
        count = 0
        while costs.per_draft is not None and count < 10_000:
            steps.run(0, 0.1)
            count += 1
        return count

    steps.run(0, 0.1, count=StepCosts.WARMUP_PLAIN)
    steps.run(2, 0.31)  # each drafted token costs a plain step
    steps.mark()
    assert costs.per_draft == pytest.approx(1.05)
    first = plain_steps_until_priced_again()
    assert first == StepCosts.FIRST_RETRY
    steps.run(2, 0.31)
    steps.mark()
    assert costs.per_draft >= 1.0
    assert plain_steps_until_priced_again() == 2 * first  # twice as long each time it does not pay
    steps.run(2, 2.0)  # a try that took 20 plain steps (a draft model catching up on a prompt)
    steps.mark()
    waited = plain_steps_until_priced_again()
    assert waited > 4 * first and 2.0 + waited * 0.1 >= StepCosts.RETRY_COST * 2.0  # a small share
    steps.run(2, 0.12)  # cheap now: drafting goes on, and a later stop retries soon again
    steps.mark()
    assert costs.per_draft < 1.0 and costs.retry == StepCosts.FIRST_RETRY


def test_a_given_draft_cost_is_never_measured():
    costs = StepCosts(fixed=0.0)
    steps = Steps(costs)
    steps.run(4, 5.0, count=10)
    steps.mark()
    assert costs.per_draft == 0.0 and not costs.wants_plain()


def test_what_a_drafted_token_costs_outlives_the_batches():
    """The engine closes its batches whenever it idles; the price learned stays with the lane."""
    from services.core.engine_config import EngineConfig
    from services.core.kind_batches import KindBatches
    from services.core.speculative import SpeculativeConfig, SpeculativeCounters

    class Counters:
        speculative = SpeculativeCounters()

    batches = KindBatches(
        EngineConfig(speculative=SpeculativeConfig(), micro_batches=2), Counters(), lambda batch, uid: True
    )
    lane = ("fp16", 0)
    costs = batches.decoder(lane).costs
    costs.ratios[2] = 1.6
    batches.reset()
    assert batches.decoder(lane).costs is costs and costs.per_draft == pytest.approx(0.3)
    assert batches.decoder(("fp16", 1)).costs is not costs  # each lane times its own steps
