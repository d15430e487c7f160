"""Fakes for the edge's mode loops (edge.lockstep, edge.cloud_led, edge.cloud_only): a stream
whose far end is a greedy cloud in memory, and a proposer, both reading one made-up target.

The target's greedy token at position n is ``target(n)``; the draft proposes the same except at
every position ``MISS`` divides (there it proposes another token), so blocks are partly accepted
and speculations restart. Every loop must hand on exactly ``target(n)`` for n past the prompt.
"""

from __future__ import annotations

import asyncio
import contextlib

from specsplit.edge.drafting import Block, DraftRule
from specsplit.edge.generation import GenerationConfig, GenerationStats
from specsplit.edge.proposer import Proposer
from specsplit.edge.sequence import Committed
from specsplit.edge.session_plan import SessionPlan
from specsplit.shared.protocol import SESSION_MODE_TO_PB, pb
from specsplit.shared.sampling import SamplingConfig
from specsplit.shared.session_mode import SessionMode

VOCAB = 50
MISS = 3
PROMPT = [1, 2, 3, 4]
GREEDY = DraftRule(SamplingConfig(), None)


def target(n: int) -> int:
    return (7 * n + 3) % VOCAB


def expected(new_tokens: int) -> list[int]:
    """What a generation after PROMPT hands on: the target's tokens."""
    return [target(n) for n in range(len(PROMPT), len(PROMPT) + new_tokens)]


class FakeProposer(Proposer):
    """Drafts ``target`` by position, wrong at every MISS-th one."""

    vocab_size = VOCAB
    tokenizer_fingerprint = None
    token_count = VOCAB
    max_positions = None

    @staticmethod
    def draft(n: int) -> int:
        return target(n) if n % MISS else (target(n) + 1) % VOCAB

    def propose(self, committed, k, rule, stop=None) -> Block:
        return Block([self.draft(len(committed) + i) for i in range(k)], None)

    def guess_next(self, committed, rule, stop=None) -> int:
        return self.draft(len(committed))

    def next_token(self, committed, rule, stop=None):
        return self.draft(len(committed)), None

    def next_token_with_alternative(self, committed, rule, stop=None):
        return self.draft(len(committed)), None, None


class FakeCloudStream:
    """What the loops see of a stream (``stats``, ``send``, ``recv``; edge.rounds also opens
    and finishes it), with a greedy cloud at
    its far end: lock-step (a Verdict per Draft) until a Draft leads, or, with ``cloud_leads``,
    until the first Draft, which the cloud then takes the lead on itself (Verdict.led), or, with
    ``leads_at_once``, until Started, after which it leads before any Draft; then
    cloud-led: a step per ``recv``, verifying the latest Draft that fits the committed prefix.
    Cloud-only answers every ``recv`` with a draftless step. ``fail_at``: the Verdict (by its
    index) whose committed_len is one too many, as a cloud out of step would send."""

    def __init__(
        self,
        new_tokens: int,
        mode: SessionMode = SessionMode.LOCK_STEP,
        max_draft_tokens: int = 4,
        cloud_leads: bool = False,
        fail_at: int | None = None,
        leads_at_once: bool = False,
    ) -> None:
        self.stats = GenerationStats(route="split")
        # what edge.rounds reads of a stream
        self.cfg = GenerationConfig(max_new_tokens=new_tokens, max_draft_tokens=max_draft_tokens)
        self.seed, self.max_new_tokens = None, new_tokens
        self.finished = False
        self.mode, self.cloud_leads, self.fail_at = mode, cloud_leads, fail_at
        self.leads_at_once = leads_at_once
        self.limit = max_draft_tokens
        self.committed_len = len(PROMPT)
        self.end = len(PROMPT) + new_tokens
        self.drafts: list[pb.Draft] = []  # every Draft received
        self.verdicts: list[pb.Verdict] = []  # every Verdict sent
        self.pool: tuple[int, int, list[int]] | None = None  # cloud-led: round, base_len, tokens
        self.queue: asyncio.Queue[pb.Verdict] = asyncio.Queue()  # lock-step Verdicts to read
        self.drafted = asyncio.Event()  # a Draft came since the last cloud-led step

    async def start(
        self, prompt, mode, draft_tokenizer=None, follows_lead=False, first_draft=False
    ) -> None:
        assert list(prompt) == PROMPT and mode is self.mode

    async def started(self) -> pb.Started:
        self.stats.observe_started(0.0, 0)
        if self.leads_at_once:  # the round trip its Probe measured: no Draft could come in time
            self.mode = SessionMode.CLOUD_LED
            self.queue.put_nowait(self._step(led=True))
        return self.started_message()

    async def finish(self, committed_len: int) -> None:
        assert committed_len == self.committed_len, "Finished's committed_len differs"
        self.finished = True

    def started_message(self) -> pb.Started:
        mode = SessionMode.LOCK_STEP if self.leads_at_once else self.mode
        started = pb.Started(session_mode=SESSION_MODE_TO_PB[mode], accepts_lead=True)
        if self.cloud_leads or self.leads_at_once:
            started.lead_after_ms = 7.5  # the bound is the server's: it leads
        started.max_new_tokens = self.end - len(PROMPT)
        started.limits.max_draft_tokens = self.limit
        started.model.vocab_size = VOCAB
        return started

    async def send(self, msg: pb.ClientMessage) -> None:
        assert self.mode is not SessionMode.CLOUD_ONLY, "a Draft in cloud-only"
        d = msg.draft
        self.drafts.append(d)
        if self.mode is SessionMode.CLOUD_LED:
            if d.continues:
                round_no, base, tokens = self.pool
                assert base + len(tokens) == d.base_len, "a continuation of another Draft"
                self.pool = (d.round, base, tokens + list(d.tokens))
            else:
                self.pool = (d.round, d.base_len, list(d.tokens))
            self.drafted.set()
            return
        assert d.base_len == self.committed_len, "a lock-step Draft off the committed prefix"
        if d.lead or self.cloud_leads:
            self.mode = SessionMode.CLOUD_LED
            self.pool = (d.round, d.base_len, list(d.tokens))
            if not d.lead:  # the cloud took the lead: its first step says so
                self.queue.put_nowait(self._step(led=True))
            return
        self.queue.put_nowait(self._verdict(d.round, list(d.tokens)))

    async def recv(self, kind: str) -> pb.Verdict:
        assert kind == "verdict"
        if self.mode is SessionMode.LOCK_STEP or not self.queue.empty():
            return await self.queue.get()
        if self.mode is SessionMode.CLOUD_LED:  # steps without waiting; a Draft may come first
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.drafted.wait(), 0.02)
            self.drafted.clear()
        return self._step()

    def _step(self, led: bool = False) -> pb.Verdict:
        """A cloud-led (or cloud-only) step: the pool's Draft where it fits the prefix."""
        c = self.committed_len
        round_no, tokens = 0, []
        if self.pool is not None:
            r, base, held = self.pool
            fits = base <= c <= base + len(held)
            if fits and all(held[i - base] == target(i) for i in range(base, c)):
                round_no, tokens = r, held[c - base :][: self.limit]
        v = self._verdict(round_no, tokens)
        v.led = led
        return v

    def _verdict(self, round_no: int, tokens: list[int]) -> pb.Verdict:
        c = self.committed_len
        tokens = tokens[: max(0, self.end - c - 1)]  # no Verdict commits past the length limit
        accepted = 0
        while accepted < len(tokens) and tokens[accepted] == target(c + accepted):
            accepted += 1
        self.committed_len = c + accepted + 1
        v = pb.Verdict(
            round=round_no,
            accepted=accepted,
            token=target(c + accepted),
            has_token=True,
            committed_len=self.committed_len,
            drafts_verified=len(tokens),
            finished=self.committed_len >= self.end,
            reason=pb.FINISH_REASON_LENGTH,
        )
        if len(self.verdicts) == self.fail_at:
            v.committed_len += 1
        self.verdicts.append(v)
        return v


def plan(mode: SessionMode = SessionMode.LOCK_STEP, **kw) -> SessionPlan:
    """A settled plan; k fixed at 4 unless ``kw`` says otherwise."""
    fields = dict(
        mode=mode,
        auto=False,
        may_lead=False,
        max_draft_tokens=4,
        adaptive=False,
        obeys_hint=False,
        follow_hint=False,
        draft_ahead=True,
    )
    return SessionPlan(**{**fields, **kw})


def committed() -> Committed:
    return Committed(PROMPT)
