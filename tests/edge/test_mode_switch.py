"""The lock-step -> cloud-led switch of session mode auto (edge/mode_switch.py), on measured
rounds: where each mode wastes its time decides, not a fixed RTT threshold."""

from __future__ import annotations

import asyncio

import pytest

from specsplit.edge.client import GenerationConfig, SplitClient
from specsplit.edge.mode_switch import MARGIN, MIN_ROUNDS, LeadChoice, Link
from tests.fakes import SlowDrafter, gateway

K = 8


def measured(
    rounds: int,
    accepted: int | list[int],
    verify_ms: float,
    rtt_ms: float,
    overhead_ms: float = 20.0,
    greedy: bool = True,
) -> LeadChoice:
    """Lock-step rounds of K drafts with ``accepted`` kept each (a list: in turn), on a link of
    ``rtt_ms``."""
    choice = LeadChoice(K, greedy)
    kept = accepted if isinstance(accepted, list) else [accepted]
    for i in range(rounds):
        cycle = verify_ms + overhead_ms + rtt_ms
        choice.observe(K, kept[i % len(kept)], cycle, verify_ms, verify_ms + overhead_ms)
    return choice


def test_no_switch_before_two_rounds_were_measured():
    """However slow the link, one round (its acceptance mostly the prior) is not enough."""
    choice = LeadChoice(K, greedy=True)
    assert choice.rates(K) is None
    assert not measured(MIN_ROUNDS - 1, accepted=8, verify_ms=20, rtt_ms=1000).should_lead(K)
    assert measured(MIN_ROUNDS, accepted=8, verify_ms=20, rtt_ms=1000).should_lead(K)


def test_cpu_cloud_on_a_lan_stays_lock_step():
    """A 450 ms target pass next to a 10 ms link: lock-step idles little, while cloud-led
    would spend a whole pass after each rejected block."""
    assert not measured(4, accepted=4, verify_ms=450, rtt_ms=10).should_lead(K)


def test_gpu_cloud_behind_a_mobile_link_switches_as_soon_as_allowed():
    """A 20 ms pass behind an 80 ms round trip: lock-step idles four passes per block."""
    assert measured(MIN_ROUNDS, accepted=4, verify_ms=20, rtt_ms=80).should_lead(K)


@pytest.mark.parametrize("accepted", [2, 5, 8])
def test_the_switch_comes_as_the_round_trip_grows(accepted):
    """For a fixed draft quality there is one crossover: below it lock-step, above cloud-led."""
    verdicts = [
        measured(6, accepted, verify_ms=300, rtt_ms=rtt).should_lead(K)
        for rtt in (0, 50, 100, 200, 400, 800, 1600)
    ]
    assert verdicts == sorted(verdicts), verdicts  # False ... False, True ... True
    assert verdicts[-1], "a round trip of five passes always favours cloud-led"


def test_a_draft_that_predicts_nothing_switches():
    """Nothing accepted: lock-step is a cloud-only stream that also waits a round trip per
    token; cloud-led at least streams at the cloud-only rate."""
    lock_step, cloud_led = measured(6, accepted=0, verify_ms=300, rtt_ms=50).rates(K)
    assert cloud_led > MARGIN * lock_step


def test_a_better_draft_switches_sooner():
    """The better the draft, the rarer the rejected blocks cloud-led pays a pass for."""

    def crossover(accepted: int) -> float:
        for rtt in range(0, 2000, 10):
            if measured(6, accepted, verify_ms=300, rtt_ms=rtt).should_lead(K):
                return rtt
        return float("inf")

    assert crossover(8) < crossover(3)


def test_sampling_switches_later_than_greedy():
    """Sampled, the cloud's own draws match the edge's guesses less often than greedy argmaxes
    (the coupling's (1 - TV) / (1 + TV)), so each rejected block costs cloud-led more steps."""

    def crossover(greedy: bool) -> float:
        for rtt in range(0, 2000, 10):
            choice = measured(6, [0, 3, 8], verify_ms=300, rtt_ms=rtt, greedy=greedy)
            if choice.should_lead(K):
                return rtt
        return float("inf")

    assert crossover(True) < crossover(False) < float("inf")


@pytest.mark.parametrize(
    ("rtt_ms", "step_ms", "lead"),
    [(1000, 400, True), (600, 400, True), (500, 400, False), (30, 20, True), (25, 20, False)],
)
def test_a_round_trip_of_1_5_steps_at_start_leads_with_the_first_draft(rtt_ms, step_ms, lead):
    assert LeadChoice.lead_at_start(rtt_ms, step_ms) is lead


def test_no_lead_at_start_without_the_servers_step():
    """An older server sends no step_ms (0), a failed measurement gives None."""
    assert not LeadChoice.lead_at_start(5000, 0.0)
    assert not LeadChoice.lead_at_start(None, 400)


@pytest.mark.parametrize("long_link", [True, False])
@pytest.mark.usefixtures("lock_step_first")
def test_a_client_starts_its_next_auto_generation_as_its_last_round_trip_says(
    monkeypatch, long_link
):
    """The client keeps the round trip and step of its last Started: where they call for a
    lead, its next auto generation asks for cloud-led in Start (a fake gateway: instant steps,
    every token 7; the rule is forced, the measured pair is what it is given). What the first
    generation's cloud-led passes yielded is made not to pay, so that only the round trip
    decides (the forced generation between them keeps that memory: test_mode_yields.py)."""
    asked: list[tuple[float | None, float]] = []

    def rule(rtt_ms, step_ms):
        asked.append((rtt_ms, step_ms))
        return long_link

    monkeypatch.setattr(LeadChoice, "lead_at_start", staticmethod(rule))
    monkeypatch.setattr(Link, "led_pays", lambda link: False)

    async def three():
        async with gateway() as address, SplitClient(address, SlowDrafter(0.001)) as client:
            gens = []
            for mode in ("auto", "lock-step", "auto"):
                gen = client.generate(
                    [1, 2, 3],
                    GenerationConfig(max_new_tokens=16, max_draft_tokens=4, session_mode=mode),
                )
                await gen.collect()
                gens.append(gen)
            return gens

    first, locked, second = asyncio.run(three())
    for gen in (first, locked, second):
        assert gen.token_ids == [7] * 16 and gen.stats.finish == "LENGTH"
    assert not first.stats.led_at_start  # nothing measured yet: lock-step ...
    # ... leading with its first Draft once Started told (without, the rounds may still switch:
    # FakeTriton accepts no draft)
    assert (first.stats.lead_round == 1) is long_link
    assert not locked.stats.led_at_start and locked.stats.lead_round == 0  # a forced mode
    assert second.stats.led_at_start is long_link
    if long_link:  # cloud-led from Start
        assert second.stats.lead_round == 0 and not second.stats.cloud_took_lead
    else:  # measuring: a lock-step round led, or the cloud did before the first Draft was
        # drafted (its bound is 1.5 of FakeTriton's 1 ms steps; edge.rounds follows at once)
        assert second.stats.lead_round >= 1 or second.stats.cloud_took_lead
    rtt_ms, step_ms = asked[-1]  # the last pair the client kept: a real round trip and step
    assert rtt_ms is not None and rtt_ms >= 0 and step_ms == 1.0  # FakeTriton's verify_ms


@pytest.mark.usefixtures("lock_step_first")
def test_a_new_client_given_an_old_ones_link_starts_as_that_link_says(monkeypatch):
    """``SplitClient(link=old.link)``: a client opened per request keeps what the last one
    measured, so its first auto generation already starts cloud-led on a slow link."""
    monkeypatch.setattr(LeadChoice, "lead_at_start", staticmethod(lambda rtt, step: True))

    async def two():
        cfg = GenerationConfig(max_new_tokens=16, max_draft_tokens=4)  # auto: the default
        async with gateway() as address:
            async with SplitClient(address, SlowDrafter(0.001)) as old:
                first = old.generate([1, 2, 3], cfg)
                await first.collect()
                link = old.link
            async with SplitClient(address, SlowDrafter(0.001), link=link) as new:
                second = new.generate([1, 2, 3], cfg)
                await second.collect()
            return first, link, second

    first, link, second = asyncio.run(two())
    assert not first.stats.led_at_start  # a fresh client: nothing measured yet
    assert isinstance(link, Link) and link.rtt_ms >= 0  # (a fresh gateway: step_ms 0 then)
    assert second.stats.led_at_start and second.token_ids == [7] * 16


@pytest.mark.parametrize("switches", [True, False])
@pytest.mark.usefixtures("lock_step_first")
def test_a_client_whose_auto_generation_ran_cloud_led_starts_the_next_one_so(monkeypatch, switches):
    """After an auto generation that measured its rounds and handed over to cloud-led, the
    client's next auto generation starts cloud-led (the rounds it would spend measuring again
    idle the target); after one that measured and stayed lock-step, the next measures again.
    (Where cloud-led paid: FakeTriton accepts no draft, so here it is forced to have paid;
    tests/edge/test_mode_yields.py has it not pay.)"""
    monkeypatch.setattr(LeadChoice, "lead_at_start", staticmethod(lambda rtt, step: False))
    monkeypatch.setattr(LeadChoice, "should_lead", lambda choice, k: switches)
    monkeypatch.setattr(Link, "led_pays", lambda link: True)

    async def two():
        cfg = GenerationConfig(max_new_tokens=16, max_draft_tokens=2)
        gens = []
        async with gateway() as address, SplitClient(address, SlowDrafter(0.001)) as client:
            for _ in range(2):
                gen = client.generate([1, 2, 3], cfg)
                await gen.collect()
                gens.append((gen.stats, client.link.led))
        return gens

    (first, led), (second, _) = asyncio.run(two())
    assert not first.led_at_start and (first.lead_round > 0) is switches and led is switches
    assert second.led_at_start is switches
    assert second.lead_round == 0 if switches else second.rounds > MIN_ROUNDS


def cpu_rounds(draft_ms_per_token: float | None, accepted=(6, 3)) -> LeadChoice:
    """Lock-step rounds at RTT 0 on a CPU target whose passes cost by rows (45 ms for one row,
    11.25 more per row), blocks of 8 and 4 in turn drafted ahead of their verdicts (10 ms idle),
    the draft's step as given (None: not reported)."""
    choice = LeadChoice(K, greedy=True)
    for i in range(6):
        k = 8 if i % 2 == 0 else 4
        verify = 33.75 + 11.25 * (k + 1)
        drafted = None if draft_ms_per_token is None else draft_ms_per_token * k
        choice.observe(k, accepted[i % 2], verify + 10, verify, verify + 3, drafted, None)
    return choice


def test_cloud_led_is_modelled_with_the_drafts_the_edge_can_supply():
    """A cloud-led step verifies what the edge drafted during the step before (a 25 ms draft
    step beside a 45 ms one-row pass: about two), not a lock-step block of eight, so its steps
    are cheap rows; and after a correction its next Draft is a draft step away, one pass. At
    RTT 0 on a CPU the switch then leads, as the full bench measured (cloud-led 1.43x
    cloud-only on code against lock-step adaptive's 1.15x); without the draft's step the
    model falls back to k and the lock-step idle, and stays."""
    assert not cpu_rounds(None).should_lead(K)
    assert cpu_rounds(25.0).should_lead(K)


def test_a_draft_slower_than_the_target_supplies_one_token_a_step():
    fast, slow = cpu_rounds(25.0).rates(K)[1], cpu_rounds(200.0).rates(K)[1]
    assert slow < fast
    choice = cpu_rounds(200.0)
    one_row = choice.lengths.verify_cost(1) + choice.overhead_ms
    assert choice._led_block(K, one_row)[0] == 1
    assert cpu_rounds(25.0)._led_block(K, one_row)[0] == 2
