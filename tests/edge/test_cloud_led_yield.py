"""Cloud-led drafting pauses where too few of the tokens it drafts are accepted
(edge.cloud_led.PAUSE_YIELD): every draft step costs the device, and the target's pass beside
it where they share a machine. The rule, then the loop against the fake greedy cloud with a
draft whose tokens are seldom accepted and one whose tokens mostly are."""

from __future__ import annotations

import asyncio

import pytest

from specsplit.edge import cloud_led
from specsplit.edge.cloud_led import (
    PAUSE_DRAWN,
    PAUSE_VERDICTS,
    PAUSE_YIELD,
    _pause,
    cloud_led_rounds,
)
from specsplit.edge.generation import GenerationStats
from specsplit.shared.session_mode import SessionMode
from tests.edge.fake_cloud import (
    GREEDY,
    PROMPT,
    FakeCloudStream,
    FakeProposer,
    committed,
    expected,
    plan,
)


@pytest.mark.parametrize(
    "drawn, accepted, pauses",
    [
        (PAUSE_DRAWN - 1, 0, False),  # not judged before PAUSE_DRAWN tokens
        (PAUSE_DRAWN, int(PAUSE_YIELD * PAUSE_DRAWN), True),  # 3 of 32
        (PAUSE_DRAWN, int(PAUSE_YIELD * PAUSE_DRAWN) + 1, False),  # 4 of 32
        (4 * PAUSE_DRAWN, 4 * PAUSE_DRAWN // 2, False),
    ],
)
def test_drafting_pauses_below_the_yield(drawn, accepted, pauses):
    stats = GenerationStats(route="split")
    got = _pause(stats, 0, 0, drawn, accepted)
    assert got == (PAUSE_VERDICTS if pauses else 0)
    assert stats.unpaid_pauses == pauses


def test_a_pause_counts_down_whatever_the_yield():
    stats = GenerationStats(route="split")
    assert _pause(stats, 5, 0, PAUSE_DRAWN, 0) == 4
    assert _pause(stats, -1, 0, PAUSE_DRAWN, 0) == -1  # no more Drafts on this stream
    assert stats.unpaid_pauses == 0


class Counting(FakeProposer):
    """Counts the tokens it drafts."""

    def __init__(self) -> None:
        self.drawn = 0

    def next_token(self, committed, rule, stop=None):
        self.drawn += 1
        return super().next_token(committed, rule, stop)


def test_the_loop_judges_the_tokens_it_drafted_and_those_accepted(monkeypatch):
    """What the loop hands the rule after each Verdict: every token its draft steps made since
    drafting started, and the draft tokens the cloud accepted of them (the fake cloud's timing
    varies from run to run, the bookkeeping does not)."""
    seen = []

    def recording(stats, paused, dropped, drawn=0, accepted=0):
        seen.append((drawn, accepted, stats.accepted))
        return _pause(stats, paused, dropped, drawn, accepted)

    monkeypatch.setattr(cloud_led, "_pause", recording)
    n = 60
    stream, seq, proposer = FakeCloudStream(n, SessionMode.CLOUD_LED), committed(), Counting()
    led = plan(SessionMode.CLOUD_LED, adaptive=True)

    async def run():
        rounds = cloud_led_rounds(stream, seq, proposer, GREEDY, led, stream.started_message())
        return [c async for c in rounds]

    chunks = asyncio.run(run())
    assert sum(chunks, []) == expected(n) and seq.tokens == PROMPT + expected(n)
    stats = stream.stats
    assert len(seen) == stats.rounds  # after every Verdict
    assert all(accepted <= drawn for drawn, accepted, _ in seen)
    if stats.unpaid_pauses == 0:  # no pause: counted from the start all along
        assert [d for d, _, _ in seen] == sorted(d for d, _, _ in seen)
        assert all(accepted == total for _, accepted, total in seen)
        assert seen[-1][0] <= proposer.drawn and stats.accepted > 0
