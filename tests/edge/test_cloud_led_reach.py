"""Cloud-led rounds draft only where a Draft can reach the cloud in time (edge.cloud_led._Reach):
past a round trip of as many target steps as the speculation holds positions worth verifying,
every Draft would arrive stale, so the edge drafts none. SplitClient against an in-process
gateway with a rule-verifying fake, through the bench's delay proxy for the long link."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import pytest

from bench.proxy import DelayProxy
from specsplit.edge.adaptive import DraftLength
from specsplit.edge.client import GenerationConfig, SplitClient
from specsplit.edge.cloud_led import PROBE_AFTER, PROBE_VERDICTS, _Reach
from specsplit.edge.rounds import FIRST_BLOCK
from tests.edge.test_cloud_takes_lead import PROMPT, RuleDrafter, RuleTarget, expected
from tests.fakes import gateway

STEP_S = 0.02  # the fake target's pass
N_NEW = 24


class SteppingTarget(RuleTarget):
    """A pass of STEP_S that reports it (Started.step_ms of the next stream)."""

    async def step(self, base_len, tokens, q=None):
        await asyncio.sleep(STEP_S)
        reply = await super().step(base_len, tokens, q)
        ms = STEP_S * 1e3
        return dataclasses.replace(reply, verify_ms=ms, roundtrip_ms=ms, max_draft_tokens_hint=16)


def _run(rtt_ms: float):
    drafter = RuleDrafter(delay_s=0.002, wrong=5)

    async def run():
        async with gateway_and_link(rtt_ms) as address, SplitClient(address, drafter) as client:
            # a first stream: the gateway measures its step for the next Started
            cfg = GenerationConfig(max_new_tokens=3, session_mode="cloud-led")
            await client.generate(PROMPT, cfg).collect()
            cfg = GenerationConfig(max_new_tokens=N_NEW, session_mode="cloud-led")
            gen = client.generate(PROMPT, cfg)
            await gen.collect()
            return gen

    return asyncio.run(run())


@contextlib.asynccontextmanager
async def gateway_and_link(rtt_ms: float):
    """The fake gateway's address, reached directly (RTT 0) or through a DelayProxy."""
    async with gateway(SteppingTarget) as address:
        if not rtt_ms:
            yield address
            return
        async with DelayProxy(int(address.rsplit(":", 1)[1]), rtt_ms=rtt_ms) as proxy:
            yield f"127.0.0.1:{proxy.port}"


def test_a_round_trip_of_more_steps_than_the_speculation_reaches_drafts_only_the_first_block():
    # 400 ms of round trip: 20 target steps, past the max_draft_tokens = 8 positions a
    # speculation reaches before any Draft was verified (and the 16 a Draft may hold). The
    # first block, drafted from the prompt, travels behind Start and is verified by the first
    # step (edge.rounds); no Draft after it could be.
    gen = _run(rtt_ms=400.0)
    s = gen.stats
    assert gen.token_ids == expected(N_NEW)
    assert s.drafts_sent == 1 and 0 < s.drafted <= FIRST_BLOCK, s.summary()
    assert s.rounds == N_NEW - s.accepted  # then the cloud stepped alone, a token a step


def test_a_short_round_trip_drafts_and_verifies():
    gen = _run(rtt_ms=0.0)
    s = gen.stats
    assert gen.token_ids == expected(N_NEW)
    assert s.drafts_sent > 0 and s.accepted > 0, s.summary()


def _measured(alpha: float, rounds: int = 50, k: int = 8) -> DraftLength:
    lengths = DraftLength(k)
    for i in range(rounds):  # position by position, a share alpha of them kept
        accepted = 0
        while accepted < k and (i * 7919 + accepted * 104729) % 100 < alpha * 100:
            accepted += 1
        lengths.observe(k, accepted, 10.0)
    return lengths


@pytest.mark.parametrize(
    ("rtt_ms", "step_ms", "out"),
    [(0.0, 50.0, False), (100.0, 50.0, False), (500.0, 50.0, True), (1000.0, 50.0, True)],
)
def test_the_lag_before_any_verdict_is_the_round_trip_in_target_steps(rtt_ms, step_ms, out):
    reach = _Reach(8, 16, _measured(0.8), rtt_ms=rtt_ms, step_ms=step_ms)
    assert reach.lag == pytest.approx(rtt_ms / step_ms)
    assert reach.out_of_reach() is out


def test_an_unknown_round_trip_or_step_reaches_as_before():
    assert _Reach(8, 16, rtt_ms=None, step_ms=50.0).lag == 0.0
    assert _Reach(8, 16, rtt_ms=500.0, step_ms=0.0).lag == 0.0
    assert not _Reach(8, 16).out_of_reach()


@pytest.mark.parametrize(("rtt_ms", "out"), [(300.0, False), (350.0, False), (400.0, True)])
def test_before_any_draft_was_verified_the_speculation_reaches_max_draft_tokens(rtt_ms, out):
    """No acceptance measured (a stream that started cloud-led): max_draft_tokens positions, not
    the few the prior alone would give (0.6 ** 5 < MIN_REACH)."""
    reach = _Reach(8, 16, rtt_ms=rtt_ms, step_ms=50.0)
    assert reach.reachable() == 8 and reach.out_of_reach() is out


def test_a_better_draft_reaches_further():
    weak, strong = _Reach(8, 16, _measured(0.5)), _Reach(8, 16, _measured(0.95))
    assert weak.reachable() < strong.reachable() <= 16


def test_the_verdicts_pace_replaces_the_servers_step():
    reach = _Reach(8, 16, _measured(0.8), rtt_ms=600.0, step_ms=50.0)
    assert reach.lag == pytest.approx(12.0)
    for i in range(9):  # a Verdict of one token every 100 ms: half the pace Started said
        reach.observe(None, 0, 0, at=0.1 * i, tokens=1)
    assert reach.token_ms == pytest.approx(100.0)
    assert reach.lag == pytest.approx(6.0)


def test_a_verified_draft_measures_the_lag_itself():
    reach = _Reach(8, 16, _measured(0.8), rtt_ms=1000.0, step_ms=50.0)
    assert reach.out_of_reach()
    reach.observe(3, 4, 4, at=0.0, tokens=5)  # a Draft verified 3 tokens after its base
    assert reach.lag == 3.0 and not reach.out_of_reach()
    for i in range(1, 9):  # the pace no longer moves a measured lag
        reach.observe(None, 0, 0, at=0.5 * i, tokens=1)
    assert reach.lag == 3.0


def _rejected_once(rtt_ms: float) -> _Reach:
    """Started said 45 ms a step; the first Draft verified came 2 tokens after its base and its
    first token was rejected: from that one measurement the speculation reaches 2 positions,
    no further than the lag (RTT 100 ms on the 2-core CPU)."""
    reach = _Reach(8, 16, rtt_ms=rtt_ms, step_ms=45.0)
    reach.observe(2, 1, 0, at=0.0, tokens=1)
    return reach


def _idle(reach: _Reach, verdicts: int) -> None:
    for _ in range(verdicts):  # Verdicts that verified no Draft of ours
        reach.observe(None, 0, 0)


def test_out_of_reach_by_measured_acceptance_drafting_probes_again():
    reach = _rejected_once(100.0)
    assert reach.reachable() == 2 and reach.out_of_reach()
    _idle(reach, PROBE_AFTER - 1)
    assert reach.out_of_reach()
    _idle(reach, 1)
    assert not reach.out_of_reach()  # a probe: the edge drafts
    reach.observe(2, 6, 6, tokens=7)  # its Draft was verified and accepted
    assert reach.reachable() > reach.lag and not reach.out_of_reach()


def test_a_probe_that_gets_nothing_verified_waits_twice_as_long_before_the_next():
    reach = _rejected_once(100.0)
    _idle(reach, PROBE_AFTER)
    _idle(reach, PROBE_VERDICTS)  # its Drafts came stale
    assert reach.out_of_reach()
    _idle(reach, 2 * PROBE_AFTER - 1)
    assert reach.out_of_reach()
    _idle(reach, 1)
    assert not reach.out_of_reach()


@pytest.mark.parametrize("rtt_ms", [500.0, 1000.0])
def test_a_round_trip_past_an_unmeasured_drafts_reach_never_probes(rtt_ms):
    """A lag of 11 or 22 steps: past the max_draft_tokens = 8 positions a speculation reaches
    before any Draft was verified, so no estimate of acceptance put it out of reach."""
    reach = _Reach(8, 16, _measured(0.3), rtt_ms=rtt_ms, step_ms=45.0)
    assert reach.out_of_reach()
    _idle(reach, 20 * PROBE_AFTER)
    assert reach.out_of_reach()


def test_reaches_says_whether_any_speculation_can_reach_the_cloud_at_start():
    """From Start's round trip and the cloud's step: 12.5 steps of lag is past the 8 positions
    an unmeasured speculation reaches; 2.5 is not; an unknown round trip, or a fixed k, drafts."""
    from specsplit.edge.cloud_led import reaches
    from specsplit.edge.session_plan import SessionPlan
    from specsplit.shared.protocol import pb

    started = pb.Started(step_ms=40.0)
    started.limits.max_draft_tokens = 8
    adaptive = SessionPlan.of(GenerationConfig(max_new_tokens=8, max_draft_tokens=8))
    fixed = SessionPlan.of(GenerationConfig(max_new_tokens=8, max_draft_tokens=8, adaptive=False))
    assert not reaches(adaptive, started, 500.0)
    assert reaches(adaptive, started, 100.0)
    assert reaches(adaptive, started, None)
    assert reaches(fixed, started, 500.0)
