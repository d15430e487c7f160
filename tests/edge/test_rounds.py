"""The edge's mode switch (edge.rounds), against fakes of the stream, the drafter and the three
mode loops (docs/design.md#handover): the dispatcher runs the loop of the mode the server runs,
and cloud-led rounds from a lock-step loop's Handover, once; no loop runs another.
"""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import grpc
import numpy as np
import pytest

from specsplit.cloud.kv_growth import MAX_DRAFT_TOKENS
from specsplit.edge import rounds as dispatcher
from specsplit.edge.adaptive import DraftLength
from specsplit.edge.drafting import Block
from specsplit.edge.generation import GenerationConfig, GenerationStats
from specsplit.edge.handover import Handover
from specsplit.edge.mode_switch import LeadChoice, Link, Yield
from specsplit.edge.session_plan import SessionPlan
from specsplit.edge.worker import Stopped, Worker
from specsplit.shared.protocol import SESSION_MODE_TO_PB, pb
from specsplit.shared.sampling import SamplingConfig, SparseDist
from specsplit.shared.session_mode import SessionMode
from tests.edge.fake_cloud import PROMPT, FakeCloudStream, FakeProposer, expected, plan


class FakeStream:
    def __init__(self, cfg: GenerationConfig, runs: SessionMode) -> None:
        self.cfg, self.runs = cfg, runs
        self.seed = None
        self.max_new_tokens = cfg.max_new_tokens
        self.stats = GenerationStats(route="split")
        self.asked: SessionMode | None = None
        self.finished: int | None = None  # the committed_len Finished was checked against

    async def start(self, prompt, mode, fingerprint, follows_lead, first_draft=False) -> None:
        self.asked = mode

    async def started(self) -> pb.Started:
        started = pb.Started(session_mode=SESSION_MODE_TO_PB[self.runs], accepts_lead=True)
        started.max_new_tokens = self.max_new_tokens
        started.limits.max_draft_tokens = 8
        started.model.vocab_size = 100
        return started

    async def finish(self, committed_len: int) -> None:
        self.finished = committed_len


PROPOSER = SimpleNamespace(
    tokenizer_fingerprint=None,
    vocab_size=100,
    token_count=100,
    propose=lambda committed, k, rule, stop: Block([5], None),
)


@pytest.mark.parametrize(
    ("session_mode", "runs", "hands_over", "loops"),
    [
        ("lock-step", SessionMode.LOCK_STEP, True, ["lockstep", "cloud_led"]),
        ("lock-step", SessionMode.LOCK_STEP, False, ["lockstep"]),
        ("cloud-led", SessionMode.CLOUD_LED, False, ["cloud_led"]),
        ("cloud-led", SessionMode.LOCK_STEP, False, ["lockstep"]),  # the server's right
    ],
)
def test_the_dispatcher_switches_once_on_a_handover(
    monkeypatch, session_mode, runs, hands_over, loops
):
    ran: list[str] = []
    received: list = []
    drafted_early: list = []
    handover = Handover(2, Block([8, 9], None), 40, DraftLength(4))

    async def lockstep(
        stream, committed, proposer, rule, plan, started, first, reading=None, sent=False
    ):
        ran.append("lockstep")
        assert first[0].tokens == [5]  # the block drafted while the cloud prefilled
        committed.tokens += [5, 6]
        yield [5, 6]
        if hands_over:
            yield handover

    async def cloud_led(
        stream, committed, proposer, rule, plan, started, given=None, early=None, early_k=0
    ):
        ran.append("cloud_led")
        received.append(given)
        if early is not None:  # the block drafted while the cloud prefilled, handed on
            block, _ = await early.result()
            await early.join()
            drafted_early.append(block.tokens)
        committed.tokens += [7]
        yield [7]

    monkeypatch.setattr(dispatcher, "lockstep_rounds", lockstep)
    monkeypatch.setattr(dispatcher, "cloud_led_rounds", cloud_led)
    cfg = GenerationConfig(max_new_tokens=64, session_mode=session_mode)
    stream = FakeStream(cfg, runs)

    async def main():
        plan = SessionPlan.of(cfg)
        return [c async for c in dispatcher.run_rounds(stream, PROPOSER, plan, [1, 2, 3])]

    chunks = asyncio.run(main())
    assert ran == loops
    assert all(isinstance(c, list) for c in chunks)  # the Handover never reaches the caller
    # one Committed through every loop the dispatcher ran, checked by Finished
    assert stream.finished == 3 + sum(len(c) for c in chunks)
    if "cloud_led" in ran:
        assert received == [handover if runs is SessionMode.LOCK_STEP else None]
    # a stream cloud-led from Start begins its speculation with the block drafted meanwhile
    assert drafted_early == ([[5]] if loops == ["cloud_led"] else [])


def test_cloud_only_runs_its_loop(monkeypatch):
    ran = []

    async def cloud_only(stream, committed):
        ran.append("cloud_only")
        committed.tokens += [4]
        yield [4]

    monkeypatch.setattr(dispatcher, "cloud_only_rounds", cloud_only)
    cfg = GenerationConfig(max_new_tokens=8)
    stream = FakeStream(cfg, SessionMode.CLOUD_ONLY)

    async def main():
        plan = SessionPlan.of(cfg, cloud_only=True)
        return [c async for c in dispatcher.run_rounds(stream, None, plan, [1, 2, 3])]

    assert asyncio.run(main()) == [[4]] and ran == ["cloud_only"]


def test_a_goodbye_lost_after_the_final_verdict_ends_the_generation(monkeypatch):
    """Every token came with a final Verdict that agreed: a stream that breaks before Finished
    ends the generation with that Verdict's reason, not an error (nor a re-open)."""

    async def cloud_only(stream, committed):
        v = pb.Verdict(token=4, has_token=True, committed_len=4, finished=True, reason=1)
        committed.commit([4], v)
        yield [4]

    class Broken(FakeStream):
        async def finish(self, committed_len: int) -> None:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "gone"
            )

    monkeypatch.setattr(dispatcher, "cloud_only_rounds", cloud_only)
    cfg = GenerationConfig(max_new_tokens=8)
    stream = Broken(cfg, SessionMode.CLOUD_ONLY)

    async def main():
        plan = SessionPlan.of(cfg, cloud_only=True)
        return [c async for c in dispatcher.run_rounds(stream, None, plan, [1, 2, 3])]

    assert asyncio.run(main()) == [[4]]
    assert stream.stats.finish == "EOS"


@pytest.mark.usefixtures("lock_step_first")
def test_the_real_loops_through_the_dispatcher_hand_over_without_losing_a_token(monkeypatch):
    """edge.rounds with the real lock-step and cloud-led loops against an in-memory greedy
    cloud (tests.edge.fake_cloud): one Committed through both, checked by Finished."""
    from tests.edge.fake_cloud import PROMPT, FakeCloudStream, FakeProposer, expected

    asked = []
    monkeypatch.setattr(
        LeadChoice, "should_lead", lambda choice, k: asked.append(k) or len(asked) == 3
    )
    n = 29
    stream = FakeCloudStream(n)
    plan = SessionPlan.of(GenerationConfig(max_new_tokens=n))  # auto: may hand over

    async def main():
        return [c async for c in dispatcher.run_rounds(stream, FakeProposer(), plan, PROMPT)]

    chunks = asyncio.run(main())
    assert sum(chunks, []) == expected(n)  # neither lost nor handed on twice
    assert stream.finished and stream.stats.lead_round == 3
    assert set(stream.stats.mode_passes) == {"lock-step", "cloud-led"}


class FirstBlockBlocked(FakeProposer):
    """Its first block (drafted while the cloud prefills) never ends until its worker is told
    to stop (edge.worker.Worker.join); every later call drafts at once."""

    def __init__(self) -> None:
        self.blocked = False
        self.released = False  # its worker was told to stop, and it stopped

    def propose(self, committed, k, rule, stop=None) -> Block:
        if not self.blocked and stop is not None:
            self.blocked = True
            stop.wait(60)
            self.released = True
            raise Stopped
        return super().propose(committed, k, rule, stop)


def test_a_cloud_that_leads_before_the_first_block_is_done_is_followed_at_once():
    """The cloud leads as it sends Started (its Probe measured a long round trip): its first
    Verdict is read while the first block still drafts, which stops, and the stream goes on
    cloud-led from that Verdict, no Draft of ours verified by it; output exact."""
    n = 12
    stream = FakeCloudStream(n, leads_at_once=True)
    plan_ = plan(auto=True, may_lead=True)

    async def main():
        return [c async for c in dispatcher.run_rounds(stream, FirstBlockBlocked(), plan_, PROMPT)]

    chunks = asyncio.run(asyncio.wait_for(main(), 30))
    assert [t for c in chunks for t in c] == expected(n)
    assert stream.verdicts[0].led and stream.verdicts[0].round == 0
    assert stream.stats.cloud_took_lead and stream.stats.lead_round == 0
    assert all(not d.lead for d in stream.drafts) and stream.finished


def test_the_first_block_fits_every_server_limit():
    """The first block leaves before Started tells the server's Limits: it must fit the least
    max_draft_tokens the protocol allows (4), which our server's own limit respects."""
    assert dispatcher.FIRST_BLOCK <= 4 <= MAX_DRAFT_TOKENS


@pytest.mark.parametrize(("adaptive", "first"), [(True, dispatcher.FIRST_BLOCK), (False, 8)])
@pytest.mark.usefixtures("lock_step_first")
def test_the_first_block_is_short_where_k_adapts(monkeypatch, adaptive, first):
    """Before any verdict, an adaptive plan's first block holds FIRST_BLOCK drafts, not the
    largest k: it is drafted and verified on the way to the first token (edge/rounds.py); a
    fixed k stays fixed."""
    monkeypatch.setattr(LeadChoice, "should_lead", lambda choice, k: False)
    sizes = []

    class Counting(FakeProposer):
        def propose(self, committed, k, rule, stop=None) -> Block:
            sizes.append(k)
            return super().propose(committed, k, rule, stop)

    stream = FakeCloudStream(20)
    cfg = GenerationConfig(max_new_tokens=20, max_draft_tokens=8, adaptive=adaptive)
    plan = SessionPlan.of(cfg)

    async def main():
        return [c async for c in dispatcher.run_rounds(stream, Counting(), plan, PROMPT)]

    assert sum(asyncio.run(main()), []) == expected(20)
    assert sizes[0] == first


class FarCloud(FakeCloudStream):
    """Start's round trip is 500 ms and the cloud steps every 40 ms: it commits 12.5 tokens
    while a Draft travels, past the 4 any speculation reaches (edge.cloud_led.reaches).
    ``prefilling``: whether the proposer's first block still ran when each Verdict was read."""

    proposer: FirstBlockBlocked | None = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.prefilling: list[bool] = []

    async def recv(self, kind: str):
        if self.proposer is not None:
            self.prefilling.append(self.proposer.blocked and not self.proposer.released)
        return await super().recv(kind)

    async def started(self) -> pb.Started:
        started = await super().started()
        self.stats.observe_started(500.0, 0)
        started.step_ms = 40.0
        return started


@pytest.mark.usefixtures("lock_step_first")
@pytest.mark.parametrize("mode", ["auto", "cloud-led"])
def test_where_no_draft_can_reach_the_cloud_the_drafts_prefill_stops(mode):
    """The first block (the draft's prefill) stops at Started instead of running out, and the
    stream goes on cloud-led with no token of it: an auto session leads with an empty Draft at
    once. (Later Drafts follow the loop's own reach, from the fake's pace.) Output exact."""
    n = 12
    session_mode = SessionMode.CLOUD_LED if mode == "cloud-led" else SessionMode.LOCK_STEP
    stream = FarCloud(n, session_mode)
    cfg = GenerationConfig(max_new_tokens=n, max_draft_tokens=4, session_mode=mode)
    proposer = stream.proposer = FirstBlockBlocked()

    async def main():
        plan_ = SessionPlan.of(cfg)
        return [c async for c in dispatcher.run_rounds(stream, proposer, plan_, PROMPT)]

    chunks = asyncio.run(asyncio.wait_for(main(), 30))  # a prefill run out would block 60 s
    assert [t for c in chunks for t in c] == expected(n)
    assert proposer.blocked  # the first block began, and was stopped before any Verdict
    assert stream.prefilling and not any(stream.prefilling)
    if mode == "auto":
        first = stream.drafts[0]
        assert first.lead and not first.tokens and stream.stats.lead_round == 1


class SlowStarted(FarCloud):
    """Started comes once a Draft has (or after 2 s): the cloud's prefill outlasts the edge's
    first block, as on a long link. ``before_started``: the Drafts received by then."""

    before_started: list[pb.Draft] | None = None

    async def start(
        self, prompt, mode, draft_tokenizer=None, follows_lead=False, first_draft=False
    ) -> None:
        assert list(prompt) == PROMPT and mode is SessionMode.CLOUD_LED  # whatever the fake runs
        self.announced = first_draft

    async def started(self) -> pb.Started:
        for _ in range(200):
            if self.drafts:
                break
            await asyncio.sleep(0.01)
        self.before_started = list(self.drafts)
        return await super().started()


@pytest.mark.parametrize("link", [None, Link(500.0, 40.0)])
def test_a_cloud_led_streams_first_block_leaves_before_started_whatever_the_link(link):
    """Cloud-led from Start, cold or warm on a link of 500 ms against 40 ms steps (the cloud
    commits 12.5 tokens while any later Draft travels): the first block, drafted from the
    prompt, leaves as round 1's Draft before Started comes, and the cloud's first step verifies
    it. Its Verdict measures no lag (it travelled with Start), so the stream then drafts nothing
    more: out of reach by the round trip. Output exact."""
    n = 12
    stream = SlowStarted(n, SessionMode.CLOUD_LED)
    cfg = GenerationConfig(max_new_tokens=n, max_draft_tokens=4)  # auto
    plan_ = SessionPlan.of(cfg, link=link)
    assert plan_.mode is SessionMode.CLOUD_LED

    async def main():
        return [c async for c in dispatcher.run_rounds(stream, FakeProposer(), plan_, PROMPT)]

    chunks = asyncio.run(asyncio.wait_for(main(), 30))
    assert [t for c in chunks for t in c] == expected(n)
    [first] = stream.before_started
    assert stream.announced  # Start.first_draft
    assert (first.round, first.base_len, first.continues) == (1, len(PROMPT), False)
    assert list(first.tokens) == [FakeProposer.draft(len(PROMPT) + i) for i in range(4)]
    assert stream.verdicts[0].round == 1 and stream.verdicts[0].drafts_verified == 4
    assert stream.drafts == [first] and stream.stats.drafts_sent == 1
    assert stream.stats.drafted == 4 and stream.stats.accepted == 2  # position 6 is a miss


def test_a_first_block_sent_before_a_lock_step_started_is_its_round_1():
    """Asked for cloud-led, a server may run lock-step (its right): the first block, sent before
    Started, is lock-step round 1's Draft, verified as such and not sent again. Output exact."""

    class LockStepAnyway(SlowStarted):
        def started_message(self) -> pb.Started:
            started = super().started_message()
            started.session_mode = SESSION_MODE_TO_PB[SessionMode.LOCK_STEP]
            return started

    n = 12
    stream = LockStepAnyway(n, SessionMode.LOCK_STEP)
    cfg = GenerationConfig(max_new_tokens=n, max_draft_tokens=4, session_mode="cloud-led")

    async def main():
        plan_ = SessionPlan.of(cfg)
        return [c async for c in dispatcher.run_rounds(stream, FakeProposer(), plan_, PROMPT)]

    chunks = asyncio.run(asyncio.wait_for(main(), 30))
    assert [t for c in chunks for t in c] == expected(n)
    assert len(stream.before_started) == 1
    assert [d.round for d in stream.drafts] == list(range(1, len(stream.drafts) + 1))
    assert [v.round for v in stream.verdicts] == [d.round for d in stream.drafts]


def test_a_sampled_first_block_sent_before_started_carries_q_as_floats():
    """Under the rejection rule every draft token needs its q; before Started the edge cannot
    know whether the server takes counts (Started.q_counts), so the first block's q goes as
    probabilities, which verify the same way."""
    n = 12
    stream = SlowStarted(n, SessionMode.CLOUD_LED)
    stream.cfg = dataclasses.replace(stream.cfg, sampling=SamplingConfig(temperature=0.7))
    stream.seed = 7
    counts = np.array([100, 27], dtype=np.uint8)
    q = [SparseDist(np.array([t, t + 1]), counts / 127.0, counts) for t in (5, 6, 7, 8)]
    block = Block([5, 6, 7, 8], q)
    plan_ = SessionPlan.of(stream.cfg)

    async def main():
        early = Worker(lambda stop: (block, 1.0))
        starting = asyncio.ensure_future(stream.started())
        sent = await dispatcher._send_first(stream, early, starting, len(PROMPT))
        await starting
        return sent

    assert plan_.mode is SessionMode.CLOUD_LED
    assert asyncio.run(main()) is block
    [first] = stream.before_started
    assert list(first.tokens) == block.tokens and len(first.q) == 4
    for q, sparse in zip(first.q, block.q, strict=True):
        assert not q.counts and list(q.token_ids) == sparse.ids.tolist()
        assert np.allclose(q.probs, sparse.probs)


def test_where_no_draft_can_reach_a_stream_with_no_first_block_leads_empty_at_once():
    """A sampled lock-step stream with no seed yet (run_rounds given a Stream with none:
    SplitClient always sends one) drafts no block before Started (its rule needs Started's
    seed). Where Started says no Draft can reach the cloud, it leads with an empty Draft at
    once, as one whose first block was stopped does, instead of drafting a block after Started
    for a Draft that comes stale. Output exact."""

    class Counting(FakeProposer):
        def __init__(self) -> None:
            self.calls = 0

        def propose(self, committed, k, rule, stop=None):
            self.calls += 1
            return super().propose(committed, k, rule, stop)

    n = 12
    stream = FarCloud(n, SessionMode.LOCK_STEP)
    sampled = dataclasses.replace(stream.cfg, sampling=SamplingConfig(temperature=0.7))
    stream.cfg = sampled
    proposer = Counting()

    async def main():
        stayed = Link(0.5, 50.0, lock_step=Yield(2.0, 90.0))  # lock-step measured: no lead
        plan_ = SessionPlan.of(sampled, link=stayed)
        return [c async for c in dispatcher.run_rounds(stream, proposer, plan_, PROMPT)]

    chunks = asyncio.run(asyncio.wait_for(main(), 30))
    assert [t for c in chunks for t in c] == expected(n)
    first = stream.drafts[0]
    assert first.lead and not first.tokens and stream.stats.lead_round == 1
    assert proposer.calls == 0


@pytest.mark.parametrize("runs", [SessionMode.CLOUD_LED, SessionMode.LOCK_STEP])
def test_a_sampled_stream_drafts_its_first_block_before_started(runs):
    """A sampled stream holds its seed before Started (SplitClient picks one where the request
    has none: edge.client._own_seed), so its first block, the draft's prefill included, drafts
    while the cloud prefills, as a greedy stream's does, cloud-led or lock-step. Output exact,
    the block's drafts verified."""
    calls: list[int] = []  # the context length of each draft call

    class Recording(FakeProposer):
        def next_token(self, committed, rule, stop=None):
            calls.append(len(committed))
            return super().next_token(committed, rule, stop)

        def propose(self, committed, k, rule, stop=None):
            calls.append(len(committed))
            return super().propose(committed, k, rule, stop)

    class SlowStarted(FakeCloudStream):
        before_started: list[int] | None = None

        async def started(self) -> pb.Started:
            for _ in range(200):  # the cloud's prefill: the draft's block may run meanwhile
                if calls:
                    break
                await asyncio.sleep(0.01)
            self.before_started = list(calls)
            return await super().started()

    n = 16
    stream = SlowStarted(n, runs)
    stream.cfg = dataclasses.replace(stream.cfg, sampling=SamplingConfig(temperature=0.7))
    stream.seed = 7  # the client's pick, sent in Start
    link = Link(0.5, 50.0, lock_step=Yield(2.0, 90.0)) if runs is SessionMode.LOCK_STEP else None
    plan_ = SessionPlan.of(stream.cfg, link=link)
    assert plan_.mode is runs

    async def main():
        return [c async for c in dispatcher.run_rounds(stream, Recording(), plan_, PROMPT)]

    chunks = asyncio.run(asyncio.wait_for(main(), 30))
    assert [t for c in chunks for t in c] == expected(n)
    assert stream.before_started == [len(PROMPT)]  # the first block, from the prompt
    assert stream.stats.drafted > 0


def test_a_link_within_reach_keeps_the_first_block():
    """At 100 ms (2.5 steps) a Draft reaches the cloud: the first block is drafted and sent."""

    class NearCloud(FarCloud):
        async def started(self) -> pb.Started:
            started = await super().started()
            self.stats.observe_started(100.0, 0)
            return started

    n = 12
    stream = NearCloud(n, SessionMode.CLOUD_LED)
    cfg = GenerationConfig(max_new_tokens=n, max_draft_tokens=4, session_mode="cloud-led")

    async def main():
        plan_ = SessionPlan.of(cfg)
        return [c async for c in dispatcher.run_rounds(stream, FakeProposer(), plan_, PROMPT)]

    assert sum(asyncio.run(main()), []) == expected(n)
    assert stream.drafts and stream.drafts[0].tokens
