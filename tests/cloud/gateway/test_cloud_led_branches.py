"""A branch Draft in the gateway's cloud-led pool (edge.cloud_led branch-ahead): the edge sends
its speculation, a branch (the same prefix, then the draft's second choice at an unsure position
and its continuation) and its speculation again. The step verifies the speculation, the freshest
consistent Draft; where it corrects the unsure position to the second choice, the next step
verifies the branch at once, with nothing sent after the correction and no wait. The loop alone
with a round that verifies against a fixed target sequence."""

from __future__ import annotations

import asyncio

from specsplit.cloud.capacity import StepTime
from specsplit.cloud.gateway.cloud_led import AfterRejection, ReadingTail, cloud_led_rounds
from specsplit.shared.protocol import pb
from tests.cloud.gateway.fakes import FakeClient, FakeRound, until

PROMPT = [1, 2, 3]
TARGET = [*PROMPT, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
UNSURE_AT = 5  # the draft's top token there is 99, its second choice the target's 12


class TargetRound(FakeRound):
    """Accepts the draft tokens that follow TARGET and commits TARGET's next token after them;
    a step measured (Started.step_ms) so that a pass after a correction may wait."""

    def __init__(self) -> None:
        super().__init__(finish_after=6, committed=PROMPT, max_draft_tokens=8)
        self.steps = StepTime()
        for rows in (1, 2, 5, 9):  # 10 s a pass: any wait would outlast the test's turns
            self.steps.observe(rows, 0, 10_000.0)

    async def verdict(self, tokens, q, t0):
        await asyncio.sleep(0)
        session = self.session
        c = session.committed_len
        accepted = 0
        while accepted < len(tokens) and tokens[accepted] == TARGET[c + accepted]:
            accepted += 1
        self.verified.append(list(tokens))
        session.committed += [*tokens[:accepted], TARGET[c + accepted]]
        return pb.Verdict(
            accepted=accepted,
            token=TARGET[c + accepted],
            has_token=True,
            committed_len=session.committed_len,
            drafts_verified=len(tokens),
        )


async def _branch_after_correction():
    step, client, tail, counts = TargetRound(), FakeClient(), ReadingTail(), AfterRejection()
    rounds = cloud_led_rounds(step, client, tail, after_rejection=counts)
    first = await anext(rounds)  # no Draft yet: commits 10
    base = first.committed_len
    speculation = [11, 99, 98]  # the draft's top tokens from base: 99 where the target has 12
    branch = [11, 12, 13, 14]  # the second choice at UNSURE_AT and the draft's tokens after it
    client.send(
        pb.Draft(round=1, base_len=base, tokens=speculation),
        pb.Draft(round=2, base_len=base, tokens=branch),
        pb.Draft(round=3, base_len=base, tokens=speculation),  # again: the freshest
    )
    await until(lambda: client.queue.empty())
    await asyncio.sleep(0)
    corrected = await anext(rounds)
    nxt = asyncio.ensure_future(anext(rounds))  # nothing sent after the correction
    await until(nxt.done, turns=200)
    after = nxt.result()
    await rounds.aclose()
    return step, corrected, after, counts


def test_a_correction_to_the_branch_token_makes_the_next_pass_verify_the_branch_at_once():
    step, corrected, after, counts = asyncio.run(_branch_after_correction())
    assert corrected.round == 3 and corrected.accepted == 1 and corrected.token == 12
    assert step.session.committed[UNSURE_AT] == 12  # the correction is the second choice
    assert after.round == 2 and after.drafts_verified == 2 and after.accepted == 2
    assert counts.passes == 1 and counts.waited == 0 and counts.draftless_waited == 0
    assert step.session.committed == TARGET[: len(step.session.committed)]
