"""After a rejection, a cloud-led step waits a bounded, measured moment for the edge's Draft
after the correction instead of verifying nothing, where the break-even of
cloud.gateway.cloud_led says waiting pays: the gateway in-process with a fake Triton that
verifies by a fixed rule and a client that answers every correction at once; the loop alone
with a scripted round and a fake clock; the rule itself."""

from __future__ import annotations

import asyncio

import grpc

from specsplit.cloud.capacity import StepTime
from specsplit.cloud.gateway.cloud_led import (
    WAIT_CAP_STEPS,
    AfterRejection,
    DraftPool,
    ReadingTail,
    _Due,
    cloud_led_rounds,
)
from specsplit.cloud.gateway.handover import Handover, PendingDraft, session_acceptance
from specsplit.cloud.gateway.triton_client import StepReply
from specsplit.shared.protocol import PROTOCOL_VERSION, pb, pb_grpc
from tests.cloud.gateway.fakes import FakeClient, FakeRound
from tests.fakes import VOCAB, FakeTriton, gateway

PROMPT = [1, 2, 3]
N_NEW = 40
# Reported as every pass's time (Started.step_ms) while each really takes 10 ms: the waits'
# bounds (hundreds of ms) end only when a Draft is lost, never while one is on its way.
STEP_MS = 1000.0


def target(prev: int) -> int:
    return (3 * prev + 1) % VOCAB


def sequence(n: int) -> list[int]:
    out = list(PROMPT)
    while len(out) < n:
        out.append(target(out[-1]))
    return out


class RuleTarget(FakeTriton):
    async def step(self, base_len, tokens, q=None) -> StepReply:
        await asyncio.sleep(0.01)
        accepted = 0
        while accepted + 1 < len(tokens) and tokens[accepted + 1] == target(tokens[accepted]):
            accepted += 1
        nxt = target(tokens[accepted])
        return StepReply(accepted=accepted, token=nxt, verify_ms=STEP_MS, roundtrip_ms=STEP_MS)


def _draft(base_len: int) -> pb.ClientMessage:
    """Four tokens after base_len, the third one wrong: a rejection two tokens in."""
    tokens = sequence(base_len + 4)[base_len:]
    tokens[2] = (tokens[2] + 1) % VOCAB
    return pb.ClientMessage(draft=pb.Draft(round=base_len, base_len=base_len, tokens=tokens))


async def _stream() -> list[pb.Verdict]:
    async with gateway(RuleTarget) as address, grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.SpeculativeDecodingStub(ch)
        warm = stub.Generate()  # one step measured: Started.step_ms
        params = pb.SamplingParams(max_new_tokens=1)
        await warm.write(
            pb.ClientMessage(
                start=pb.Start(
                    protocol_version=PROTOCOL_VERSION, prompt_ids=PROMPT, sampling=params
                )
            )
        )
        await warm.read()
        await warm.write(pb.ClientMessage(draft=pb.Draft(round=1, base_len=len(PROMPT))))
        while (await warm.read()).WhichOneof("msg") != "finished":
            pass
        await warm.done_writing()

        call = stub.Generate()
        params = pb.SamplingParams(max_new_tokens=N_NEW)
        start = pb.Start(
            protocol_version=PROTOCOL_VERSION,
            prompt_ids=PROMPT,
            sampling=params,
            session_mode=pb.SESSION_MODE_CLOUD_LED,
        )
        await call.write(pb.ClientMessage(start=start))
        await call.read()
        await call.write(_draft(len(PROMPT)))
        verdicts = []
        while (msg := await call.read()).WhichOneof("msg") == "verdict":
            v = msg.verdict
            verdicts.append(v)
            if not v.finished and v.accepted < v.drafts_verified:  # corrected: draft after it
                await call.write(_draft(v.committed_len))
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK
        return verdicts


def test_the_pass_after_a_correction_verifies_the_drafts_sent_after_it():
    verdicts = asyncio.run(_stream())
    rejected = [i for i, v in enumerate(verdicts[:-1]) if v.accepted < v.drafts_verified]
    assert len(rejected) >= 3
    # Half the drafts accepted: a wait pays. The first correction's pass waits until its Draft
    # comes (no delay measured yet), the later ones as their Drafts are measured due at once.
    draftless = [i for i in rejected if verdicts[i + 1].drafts_verified == 0]
    assert draftless == [], [(v.accepted, v.drafts_verified) for v in verdicts]
    assert verdicts[-1].finished and verdicts[-1].committed_len == len(PROMPT) + N_NEW


# The loop alone: a scripted round, time from a fake clock (the waits themselves are real, and
# end when the test's Draft arrives: a fake step of 10 s keeps any other end far away).


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def flat_steps(step_ms: float) -> StepTime:
    """Passes that take ``step_ms`` whatever their rows (a curve of several sizes)."""
    steps = StepTime()
    for rows in (1, 2, 5, 9):
        steps.observe(rows, 0, step_ms)
    return steps


class ScriptedRound(FakeRound):
    """Accepts ``accept`` draft tokens of each step (all of them where it has fewer) and
    corrects the next with token 90 + the step's number, or adds bonus 7 after them all."""

    def __init__(self, accept: int, step_ms: float, steps: int = 40) -> None:
        super().__init__(finish_after=steps)
        self.accept = accept
        self.steps = flat_steps(step_ms)

    async def verdict(self, tokens, q, t0):
        await asyncio.sleep(0)  # a step yields to the event loop, as a real one does
        session, n = self.session, len(self.verified)
        accepted = min(self.accept, len(tokens))
        token = 90 + n if accepted < len(tokens) else 7
        self.verified.append(list(tokens))
        session.committed += [*tokens[:accepted], token]
        return pb.Verdict(
            accepted=accepted,
            token=token,
            has_token=True,
            committed_len=session.committed_len,
            drafts_verified=len(tokens),
        )


def _draft_after(v: pb.Verdict, round_no: int) -> pb.Draft:
    return pb.Draft(round=round_no, base_len=v.committed_len, tokens=[1, 2, 3, 4])


async def _turns(n: int = 50) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def _corrections(
    accept: int, n: int, step_ms: float = 10_000.0, handover: Handover | None = None
):
    """A session whose steps accept ``accept`` of 4 drafts; the client's Draft after each of
    ``n`` corrections comes 0.6 of a step after it. Returns, per pass after a correction,
    whether the loop waited (it had not stepped after the client's turn) and its Verdict, and
    the loop's AfterRejection counts. ``handover``: the loop goes on from a lock-step session."""
    step, client, tail, clock = ScriptedRound(accept, step_ms), FakeClient(), ReadingTail(), Clock()
    counts = AfterRejection()
    rounds = cloud_led_rounds(step, client, tail, handover, after_rejection=counts, clock=clock)
    client.send(_draft_after(await anext(rounds), 1))  # after the first pass: the reader runs
    await _turns()
    v = await anext(rounds)
    out = []
    for i in range(n):
        assert v.accepted < v.drafts_verified  # a correction
        nxt = asyncio.ensure_future(anext(rounds))
        await _turns()
        waited = not nxt.done()
        clock.t += 0.6 * step_ms / 1e3
        client.send(_draft_after(v, i + 2))  # after the correction: due at 0.6 of a step
        v = await nxt
        out.append((waited, v))
        if not waited:  # stepped without it: its Draft is stale, the next one after this pass
            assert v.drafts_verified == 0
            client.send(_draft_after(v, 100 + i))
            await _turns()
            v = await anext(rounds)
    await rounds.aclose()
    return out, counts


def test_with_acceptance_near_0_7_the_pass_waits_for_a_draft_due_at_0_6_step_and_verifies_it():
    out, counts = asyncio.run(_corrections(accept=3, n=4))
    # 3 of 4 accepted (acceptance 0.67-0.72): a wait up to one step pays for a Draft of 4
    assert [waited for waited, _ in out] == [True] * 4
    assert [v.drafts_verified for _, v in out] == [4] * 4
    assert counts == AfterRejection(passes=4, waited=4)


def test_with_acceptance_0_25_to_0_1_the_pass_does_not_wait_for_a_draft_due_at_0_6_step():
    out, counts = asyncio.run(_corrections(accept=0, n=8))
    # The first correction waits (no delay measured yet); from then on, none accepted: waiting
    # 0.6 of a step pays only above acceptance ~0.4, and each pass steps at once, draftless.
    assert [waited for waited, _ in out] == [True] + [False] * 7
    assert [v.drafts_verified for _, v in out[1:]] == [0] * 7
    assert counts == AfterRejection(passes=8, waited=1, draftless_unwaited=7)


def test_after_a_handover_the_wait_starts_from_the_acceptance_lock_step_measured():
    # None accepted: from the prior alone the session's acceptance falls under 0.4, and the
    # Drafts due at 0.6 of a step are not waited for once measured (as above).
    out, _ = asyncio.run(_corrections(accept=0, n=3))
    assert [waited for waited, _ in out] == [True, False, False]
    # The same after 20 lock-step blocks all accepted: still over 0.9, a wait up to the cap
    acceptance = session_acceptance()
    for _ in range(20):
        acceptance.observe(4, 4)
    out, counts = asyncio.run(_corrections(accept=0, n=3, handover=Handover(acceptance=acceptance)))
    assert [waited for waited, _ in out] == [True] * 3
    assert [v.drafts_verified for _, v in out] == [4] * 3
    assert counts == AfterRejection(passes=3, waited=3)


def test_a_draft_that_never_comes_stalls_the_pass_no_longer_than_the_bound():
    async def main():
        step, client, tail = ScriptedRound(accept=3, step_ms=20.0), FakeClient(), ReadingTail()
        counts = AfterRejection()
        rounds = cloud_led_rounds(step, client, tail, after_rejection=counts, clock=Clock())
        client.send(_draft_after(await anext(rounds), 1))
        await _turns()
        assert (await anext(rounds)).accepted == 3
        v = await anext(rounds)  # the client never answers the correction
        assert v.drafts_verified == 0
        assert counts == AfterRejection(passes=1, draftless_waited=1)
        await rounds.aclose()

    asyncio.run(main())


# The rule: bound_ms is min(w*, WAIT_CAP_STEPS * s_1), w* = E(a, k) s_1 - s_(k+1)


def _due(ms: float | None, k: float | None, since: float = 10.0) -> _Due:
    due = _Due()
    due.rejected(now=since)
    due.ms, due.k = ms, k
    return due


def test_the_bound_is_the_break_even_of_the_expected_tokens_against_the_step_cost():
    steps = flat_steps(50.0)
    # E(0.7, 1) = 1.7 tokens, rows free: waiting up to 0.7 of a step pays
    assert abs(_due(None, None).bound_ms(steps, 0.7, limit=8) - 35.0) < 1e-9
    # E(0.1, 1) = 1.1: only a tenth of a step
    assert abs(_due(None, None).bound_ms(steps, 0.1, limit=8) - 5.0) < 1e-9
    # E(0.7, 4) = 2.77: more than a step would pay, capped at one
    assert _due(None, 4.0).bound_ms(steps, 0.7, limit=8) == WAIT_CAP_STEPS * 50.0
    # k is at most what the session may verify
    assert abs(_due(None, 4.0).bound_ms(steps, 0.7, limit=1) - 35.0) < 1e-9


def test_rows_that_cost_more_than_the_drafts_bring_leave_no_wait():
    steps = StepTime()
    for rows, ms in ((1, 50.0), (2, 100.0), (4, 200.0)):  # every row a whole step
        steps.observe(rows, 0, ms)
    assert _due(None, 1.0).bound_ms(steps, 0.7, limit=8) == 0.0  # 1.7 s_1 - 2 s_1 < 0


def test_the_wait_runs_from_the_rejection_to_the_bound_only_while_the_draft_is_due_in_it():
    steps = flat_steps(50.0)  # a = 0.7, k = 1: bound 35 ms
    assert abs(_due(30.0, 1.0).wait_s(steps, 0.7, 8, now=10.01) - 0.025) < 1e-9
    assert _due(40.0, 1.0).wait_s(steps, 0.7, 8, now=10.0) == 0.0  # due past the bound
    assert _due(30.0, 1.0).wait_s(steps, 0.7, 8, now=10.04) == 0.0  # the bound has passed
    assert _due(30.0, 1.0).wait_s(StepTime(), 0.7, 8, now=10.0) == 0.0  # no step measured
    # Nothing measured: one wait up to the bound measures it
    assert abs(_due(None, None).wait_s(steps, 0.7, 8, now=10.0) - 0.035) < 1e-9
    due = _due(None, None)
    due.expired(now=10.035)
    assert abs(due.ms - 35.0) < 1e-9


def test_no_wait_is_longer_than_the_cap_whatever_the_acceptance():
    steps = flat_steps(50.0)
    for a in (0.0, 0.5, 0.9, 0.999):
        for k in (1.0, 4.0, 8.0, 64.0):
            assert _due(0.0, k).wait_s(steps, a, 64, now=10.0) <= WAIT_CAP_STEPS * 0.05 + 1e-12


def test_the_delay_and_k_are_measured_at_the_first_consistent_draft():
    pool, due = DraftPool(), _Due()
    committed = [1, 2, 3, 9]  # 9: the correction
    due.rejected(now=10.0)
    pool.add(PendingDraft(1, 3, [4, 5], None))  # after the rejected token: not consistent
    due.observe(pool, committed, now=10.01)
    assert due.ms is None and not due.arrived.is_set()
    pool.add(PendingDraft(2, 4, [5, 6, 7], None))
    due.observe(pool, committed, now=10.02)
    assert abs(due.ms - 20.0) < 1e-9 and due.k == 3 and due.arrived.is_set()
