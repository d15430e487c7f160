"""Branch-ahead drafts in greedy cloud-led sessions (edge.cloud_led): where the draft is unsure
of a token, the edge also sends the continuation after its second choice, so that the pass after
a correction to that choice verifies it. The loop against a scripted far end that holds every
Draft (tests.edge.fake_cloud) and a proposer unsure exactly where it is wrong."""

from __future__ import annotations

import asyncio
import dataclasses

from specsplit.cloud.gateway.cloud_led import DraftPool, PendingDraft
from specsplit.edge.cloud_led import cloud_led_rounds
from specsplit.edge.drafting import Alternative, DraftRule
from specsplit.shared.coupling import SharedNoise
from specsplit.shared.sampling import SamplingConfig
from specsplit.shared.session_mode import SessionMode
from tests.edge.fake_cloud import (
    GREEDY,
    MISS,
    VOCAB,
    FakeCloudStream,
    FakeProposer,
    committed,
    expected,
    plan,
    target,
)

N_NEW = 40


class UnsureProposer(FakeProposer):
    """Wrong at every MISS-th position, as FakeProposer, and unsure there (top-1 probability
    0.5), with the target's token as its second choice; sure (0.9) elsewhere."""

    def next_token_with_alternative(self, committed, rule, stop=None):
        n = len(committed)
        token = self.draft(n)
        if n % MISS:
            return token, None, Alternative((token + 1) % VOCAB, 0.9, 0.05)
        return token, None, Alternative(target(n), 0.5, 0.4)


class PoolCloud(FakeCloudStream):
    """A cloud-led far end that holds every Draft in the gateway's pool and verifies what it
    lends (cloud.gateway.cloud_led.DraftPool.take: the freshest consistent Draft, a branch only
    where no other is), not only the last, a step every STEP_S (the fake proposer drafts in
    microseconds: the speculation reaches its length, and the edge has time to branch, between
    two steps). Its Verdicts reach the edge a step late: the step after a correction runs before
    the edge has heard of it, as on a link whose round trip is a step long."""

    STEP_S = 0.01

    def __init__(self, new_tokens: int, branch_ahead: bool = True) -> None:
        super().__init__(new_tokens, SessionMode.CLOUD_LED)
        self.cfg = dataclasses.replace(self.cfg, branch_ahead=branch_ahead)
        self.held = DraftPool()
        self.late: list = []  # Verdicts not delivered yet

    async def send(self, msg) -> None:
        await super().send(msg)
        d = msg.draft
        draft = PendingDraft(d.round, d.base_len, list(d.tokens), None, branch=d.branch)
        self.held.add(draft, d.continues, self.committed_len)

    async def recv(self, kind: str):
        while not self.late or (len(self.late) < 2 and not self.late[-1].finished):
            await asyncio.sleep(self.STEP_S)
            self.late.append(self._step())
        return self.late.pop(0)

    def _step(self, led: bool = False):
        # positions before the first Draft's base_len (the prompt) are never compared
        committed = [target(i) for i in range(self.committed_len)]
        draft, tokens, _ = self.held.take(committed, self.limit)
        return self._verdict(0, []) if draft is None else self._verdict(draft.round, tokens)


def _run(stream: FakeCloudStream, rule: DraftRule = GREEDY) -> list[int]:
    rounds = cloud_led_rounds(
        stream,
        committed(),
        UnsureProposer(),
        rule,
        plan(SessionMode.CLOUD_LED),
        stream.started_message(),
    )

    async def run():
        return [c async for c in rounds]

    return sum(asyncio.run(run()), [])


def _branches(stream: FakeCloudStream) -> list:
    """Drafts holding the target's token at a position the draft gets wrong: only a branch
    (the second choice there) does."""
    return [
        d
        for d in stream.drafts
        if any(
            (d.base_len + i) % MISS == 0 and t == target(d.base_len + i)
            for i, t in enumerate(d.tokens)
        )
    ]


def test_an_unsure_position_yields_a_branch_draft_with_the_second_choice():
    stream = PoolCloud(N_NEW)
    assert _run(stream) == expected(N_NEW)
    branches = _branches(stream)
    assert branches and stream.stats.branches_sent == len(branches)
    for d in branches:  # a full Draft from the committed prefix, the second choice inside it
        assert d.branch and not d.continues
        assert len(d.tokens) <= stream.limit
    assert not any(d.branch for d in stream.drafts if d not in branches)


def test_a_correction_to_the_second_choice_makes_the_next_pass_verify_the_branch():
    stream = PoolCloud(N_NEW)
    assert _run(stream) == expected(N_NEW)
    s = stream.stats
    assert s.corrections > 0 and s.corrections_branched > 0
    assert 0 < s.branch_passes <= s.passes_after_rejection
    rounds = {d.round for d in _branches(stream)}
    after = [
        stream.verdicts[i + 1]
        for i, v in enumerate(stream.verdicts[:-1])
        if v.accepted < v.drafts_verified
    ]
    assert any(v.round in rounds and v.drafts_verified for v in after)


def test_without_branch_ahead_no_branch_is_sent_and_the_output_is_the_same():
    stream = PoolCloud(N_NEW, branch_ahead=False)
    assert _run(stream) == expected(N_NEW)
    s = stream.stats
    assert _branches(stream) == [] and s.branches_sent == 0
    assert s.corrections > 0 and s.corrections_branched == 0 and s.branch_passes == 0


def test_no_branch_at_temperature_above_zero():
    sampled = DraftRule(SamplingConfig(temperature=0.7), SharedNoise(1, VOCAB))
    stream = PoolCloud(N_NEW)
    _run(stream, sampled)  # the fake cloud is greedy: its output is the target's either way
    assert _branches(stream) == [] and stream.stats.branches_sent == 0
