"""Cloud-led rounds count the passes right after a correction and the draftless ones among them
(GenerationStats): SplitClient against an in-process gateway with a rule-verifying fake."""

from __future__ import annotations

import asyncio

from specsplit.edge.client import GenerationConfig, SplitClient
from tests.edge.test_cloud_takes_lead import PROMPT, RuleDrafter, RuleTarget, expected
from tests.fakes import gateway


class SlowRuleTarget(RuleTarget):
    """Each pass takes 20 ms: ten of the drafter's tokens, so drafts reach the cloud in time."""

    async def step(self, base_len, tokens, q=None):
        await asyncio.sleep(0.018)
        return await super().step(base_len, tokens, q)


def test_passes_after_a_correction_are_counted_and_the_output_is_the_targets():
    drafter = RuleDrafter(delay_s=0.002, wrong=5)  # wrong after multiples of 5

    async def run():
        async with gateway(SlowRuleTarget) as address, SplitClient(address, drafter) as client:
            cfg = GenerationConfig(max_new_tokens=48, session_mode="cloud-led", follow_hint=False)
            gen = client.generate(PROMPT, cfg)
            await gen.collect()
            return gen

    gen = asyncio.run(run())
    s = gen.stats
    assert gen.token_ids == expected(48)
    assert s.accepted < s.drafted  # corrections happened ...
    assert 0 < s.passes_after_rejection <= s.rounds - 1  # ... and a pass followed them
    assert 0 <= s.draftless_after_rejection <= s.passes_after_rejection


def test_drafting_pauses_once_the_cloud_dropped_every_draft_as_stale():
    """A round trip of many target steps: every Draft arrives after the cloud passed it. After
    PAUSE_STALE such Drafts and none verified, the edge stops sending them (each costs the
    cloud's core a decode and a check) for PAUSE_VERDICTS verdicts, then counts afresh."""
    from specsplit.edge.cloud_led import PAUSE_STALE, PAUSE_VERDICTS, _pause
    from specsplit.edge.generation import GenerationStats

    stats = GenerationStats(route="split")
    assert _pause(stats, 0, PAUSE_STALE - 1) == 0
    assert _pause(stats, 0, PAUSE_STALE) == PAUSE_VERDICTS
    assert _pause(stats, 5, PAUSE_STALE) == 4  # paused: counts down
    stats.drafted, stats.accepted = 3, 2  # some Draft was verified: stale ones are timing
    assert _pause(stats, 0, 10 * PAUSE_STALE) == 0
