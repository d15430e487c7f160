"""What each session mode really yielded on a link decides how a warm auto client starts
(edge.mode_switch.Yield, Link.led_pays): a cloud-led run that verified few drafts is not
repeated from memory, and the faster mode measured is the one started."""

from __future__ import annotations

import asyncio

import pytest

from specsplit.edge.client import GenerationConfig, SplitClient, _remembered
from specsplit.edge.generation import GenerationStats
from specsplit.edge.mode_switch import (
    CLOUD_LED,
    LED_MIN_TOKENS_PER_PASS,
    LOCK_STEP,
    MARGIN,
    LeadChoice,
    Link,
    Yield,
)
from specsplit.edge.session_plan import SessionPlan
from specsplit.shared.session_mode import SessionMode
from tests.edge.test_mode_switch import K, measured
from tests.fakes import SlowDrafter, gateway

LAN = Link(rtt_ms=0.5, step_ms=50.0, led=True)  # no lead at start by the round trip
FAST_LED, PROSE_LED = Yield(2.2, 55.0), Yield(1.3, 55.0)  # code and prose at RTT 0 on the CPU
POOR_LED = Yield(1.02, 53.0)  # next to no draft verified: slower than cloud-only's 50 ms steps
LOCK = Yield(2.6, 110.0)  # a lock-step round: a pass over k + 1 rows and the idle beside it


def test_a_remembered_cloud_led_run_starts_cloud_led_only_where_it_paid():
    assert LAN.starts_led()  # cloud-led unmeasured: as before, the last run's mode
    assert LAN._replace(cloud_led=FAST_LED).starts_led()
    # no lock-step to compare with: cloud-led's rate against the cloud-only pace (1 / step_ms).
    # Prose's 1.3 tokens a pass of 55 ms is 1.18x the 50 ms step: it paid ...
    assert LAN._replace(cloud_led=PROSE_LED).starts_led()
    # ... next to no draft verified did not: lock-step measures next
    assert not LAN._replace(cloud_led=POOR_LED).starts_led()
    # no step known (an older server): tokens per pass decide, as before
    assert not LAN._replace(step_ms=0.0, cloud_led=PROSE_LED).starts_led()
    assert PROSE_LED.tokens_per_pass < LED_MIN_TOKENS_PER_PASS
    # both measured: the faster rate (2.2 / 55 > 2.6 / 110 > 1.3 / 55 tokens per ms)
    assert LAN._replace(cloud_led=FAST_LED, lock_step=LOCK).starts_led()
    assert not LAN._replace(cloud_led=PROSE_LED, lock_step=Yield(2.6, 90.0)).starts_led()


def test_a_long_round_trip_starts_cloud_led_whatever_it_yielded():
    """There lock-step idles the target a round trip per block: cloud-led with no draft is
    cloud-only's pace, lock-step slower."""
    far = Link(rtt_ms=500.0, step_ms=50.0, led=True, cloud_led=Yield(1.0, 53.0), lock_step=LOCK)
    assert far.starts_led()


def test_the_plan_follows_the_clouds_lead_only_where_cloud_led_paid():
    cfg = GenerationConfig(max_new_tokens=16)
    stayed = LAN._replace(led=False, lock_step=LOCK)  # lock-step measured, cloud-led not
    assert SessionPlan.of(cfg, link=stayed).follows_lead
    poor = LAN._replace(led=False, cloud_led=POOR_LED)
    plan = SessionPlan.of(cfg, link=poor)
    assert plan.mode is SessionMode.LOCK_STEP and plan.led == POOR_LED
    assert plan.may_lead and not plan.follows_lead


def test_a_measured_cloud_led_rate_replaces_the_model_in_the_switch():
    choice = measured(4, accepted=4, verify_ms=20, rtt_ms=80)  # the model says: lead
    lock_step, cloud_led = choice.rates(K)
    assert choice.should_lead(K) and cloud_led >= MARGIN * lock_step
    choice.led = Yield(1.0, 1.0 / (0.9 * lock_step))  # what cloud-led made here: slower
    assert not choice.should_lead(K)
    choice.led = Yield(1.0, 1.0 / (1.2 * lock_step))
    assert choice.should_lead(K)


def test_a_generation_remembers_the_modes_it_ran_and_keeps_the_others():
    stats = GenerationStats(route="split")
    for ms in (100.0, 120.0, 110.0):
        stats.observe_pass(LOCK_STEP, 3, ms)
    stats.observe_pass(CLOUD_LED, 2, 50.0)  # one pass: too few to judge
    before = Link(0.4, 48.0, cloud_led=POOR_LED, lock_step=Yield(9.0, 9.0))
    link = Link(0.5, 50.0).measured(stats, before)
    assert link.lock_step == Yield(3.0, 110.0)
    assert link.cloud_led == POOR_LED  # not run long enough: what memory held
    assert Link(0.5, 50.0).measured(GenerationStats(route="split"), None) == Link(0.5, 50.0)


@pytest.mark.usefixtures("lock_step_first")
def test_a_cloud_led_run_that_verified_no_draft_is_not_started_again(monkeypatch):
    """FakeTriton accepts no draft: the first auto generation hands over at its first round
    (forced), its cloud-led passes make one token each, and the client's next auto generation
    starts lock-step and does not hand over, as the remembered cloud-led rate is the one its
    switch compares with."""
    monkeypatch.setattr(LeadChoice, "lead_at_start", staticmethod(lambda rtt, step: False))
    remembered = []

    def should_lead(choice, k):
        remembered.append(choice.led)
        return choice.led is None  # leads unless a cloud-led yield was remembered

    monkeypatch.setattr(LeadChoice, "should_lead", should_lead)

    async def two():
        cfg = GenerationConfig(max_new_tokens=16, max_draft_tokens=2)
        gens = []
        async with gateway() as address, SplitClient(address, SlowDrafter(0.001)) as client:
            for _ in range(2):
                gen = client.generate([1, 2, 3], cfg)
                await gen.collect()
                gens.append((gen.stats, client.link))
        return gens

    (first, link), (second, _) = asyncio.run(two())
    assert first.lead_round == 1 and link.led
    assert link.cloud_led is not None and link.cloud_led.tokens_per_pass == 1.0
    assert not second.led_at_start and second.lead_round == 0
    assert remembered[0] is None and remembered[-1] == link.cloud_led


def test_a_forced_or_cloud_only_generation_keeps_what_auto_learnt():
    """The CLI saves the client's link after every generation: a `--route cloud-only` or a forced
    mode in between must not erase the yields and choice the auto generations measured."""
    learnt = Link(0.4, 48.0, led=True, cloud_led=FAST_LED, lock_step=LOCK)
    fresh = Link(0.6, 47.0)  # what the new Started measured
    stats = GenerationStats(route="cloud-only")
    for plan in (
        SessionPlan.of(GenerationConfig(), cloud_only=True),
        SessionPlan.of(GenerationConfig(session_mode="lock-step")),
    ):
        kept = _remembered(fresh, plan, stats, learnt)
        assert kept == Link(0.6, 47.0, led=True, cloud_led=FAST_LED, lock_step=LOCK)
    assert (
        _remembered(fresh, SessionPlan.of(GenerationConfig(), cloud_only=True), stats, None)
        == fresh
    )
