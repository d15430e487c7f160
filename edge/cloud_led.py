"""Cloud-led rounds on the edge (docs/design.md#cloud-led): draft ahead continuously, never hold the
cloud up.

The cloud streams one Verdict per target step whether or not Drafts arrive. Here the edge keeps
a speculation: its own draft tokens after the committed prefix, extended one token at a time in
a worker thread (``Proposer.next_token`` under the stream's ``DraftRule``). Each new token is
sent at once: the whole speculation from its latest known committed_len after a restart, else
only the new token as a continuation (Draft.continues) of the Draft before; the cloud verifies
the part it has not committed yet. (The cloud takes the freshest Draft before each step, so a
token held back for a bigger message is a token the next step cannot verify: sending every
fourth token cost 15% of the tokens/s on a CPU target whose step is 2.5 draft tokens long.)
A Verdict that agrees with the speculation consumes its head; one that does not restarts it
from the committed prefix.

Draft randomness is the session's shared numbers at each position (shared/coupling.py), so a
token drafted twice after the same prefix is the same token (a speculation rebuilt after a Verdict
equals the one drafted before it), and where the cloud draws a position itself, with no Draft
there, it often draws the token the speculation holds, which keeps the speculation after it
alive at T > 0.
Branch-ahead (greedy sessions, ``GenerationConfig.branch_ahead``, off by default): once the
speculation reaches what the next step verifies (``_Reach.first``), at its earliest position (past
the lag) where the draft's top token has probability under UNSURE, the edge also drafts the
continuation after its second choice (``Alternative``, BRANCH_TOKENS in all) and sends it as a
full Draft marked Draft.branch: the speculation up to that position, the second choice, its
continuation (base_len is committed_len: a Draft based past the cloud's committed_len is refused).
If the cloud corrects that position to the second choice, its pool already holds a Draft consistent
with the correction, and the next step verifies it without waiting for the edge to hear of it. The
cloud verifies a branch only where no other Draft is consistent, so a step that comes between the
branch and the speculation's next Draft still verifies the speculation. The speculation is then
sent again in full, so that its next token continues it (Draft.continues never extends a branch).
Where the correction was the branch, the speculation restarts from the branch's tokens instead of
drafting them again. At T > 0 no branch: a draft token must be drawn from the q sent with
it, and a second choice is no draw.
Drafting stops where no Draft can be verified: while the tokens the cloud commits during a round
trip (measured, or estimated from Start's round trip and the cloud's pace) are more than the
speculation holds positions worth verifying (``_Reach.out_of_reach``). It pauses when it does
not pay (almost nothing accepted, or every Draft dropped as stale); the cloud streams on
regardless.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import numpy as np

from specsplit.edge.adaptive import DraftLength
from specsplit.edge.drafting import Alternative, Block, DraftRule
from specsplit.edge.handover import Handover
from specsplit.edge.mode_switch import CLOUD_LED
from specsplit.edge.proposer import Proposer
from specsplit.edge.sequence import Committed
from specsplit.edge.session_plan import SessionPlan
from specsplit.edge.stream import Stream
from specsplit.edge.worker import Stopped, Worker
from specsplit.shared.protocol import pb, sparse_to_pb

PAUSE_BELOW = 0.1  # acceptance under which drafting pauses ...
PAUSE_VERDICTS = 32  # ... for this many verdicts, then tries again
# Drafts the cloud dropped as stale, none verified, after which drafting pauses as well: the
# round trip is more target steps than the speculation reaches ahead, and every Draft costs the
# edge a draft step and the cloud's core a decode and a check for nothing (about 0.6 ms of
# gateway CPU a Draft on the 2-core CPU; the target's slower passes beside stale Drafts in the
# RTT 500-1000 ms bench came while the edge drafted them, not while they arrived).
PAUSE_STALE = 8
# Out of reach by its measured acceptance, not by the round trip alone (an unmeasured draft
# would still reach), drafting tries again after this many Verdicts (doubled after each try that got
# no Draft verified), for at most PROBE_VERDICTS: an estimate made from one rejected Draft
# (reach 2 positions against a lag of 2.2 at RTT 100 ms on the 2-core CPU) must not stop a
# good draft for the rest of the stream.
PROBE_AFTER = 8
PROBE_VERDICTS = 8
PACE_TOKENS = 4  # tokens whose Verdicts measure the cloud's pace before it replaces Started.step_ms
SENT_KEPT = 64  # Drafts remembered to read Verdicts against
# A draw whose prefix a Verdict passed but still holds (the cloud committed past it, nothing
# rejected) runs on where it forwards at least this many tokens the draft's cache lacks (a
# prefill, a catch-up after draftless steps): cut short, it would cache none of them, and where
# such a pass takes longer than the cloud's step every Verdict cut it again. A shorter one is
# cut (its token is stale) and its tokens go into the next pass, which costs about as much: on
# the 2-core EPYC the draft forwards 1, 2, 4, 8 and 16 tokens in 18, 26, 30, 48 and 84 ms.
CATCH_UP = 4
# Branch-ahead: the draft's top-token probability under which a position gets a branch
# (measured: docs/design.md#cloud-led), the tokens of a branch (its second choice first), and the
# branches held at once for positions not committed yet.
UNSURE = 0.6
BRANCH_TOKENS = 4
BRANCHES = 2


class _Speculation:
    """Draft tokens (and their q) after the committed prefix."""

    def __init__(self, lead: Block | None = None, committed_len: int = 0) -> None:
        self.tokens: list[int] = []
        self.q: list = []
        self.alts: list[Alternative | None] = []  # the draft's second choice at each token
        self.sent_to: int | None = None  # where the last Draft of this speculation ended
        if lead is not None:  # a lock-step stream's lead Draft: sent already
            self.tokens, self.q = list(lead.tokens), list(lead.q or [None] * len(lead.tokens))
            self.alts = [None] * len(lead.tokens)
            self.sent_to = committed_len + len(lead.tokens)

    def add(self, token: int, q, alt: Alternative | None = None) -> None:
        self.tokens.append(token)
        self.q.append(q)
        self.alts.append(alt)

    def consume(self, chunk: list[int]) -> None:
        if self.tokens[: len(chunk)] == chunk:
            n = len(chunk)
            self.tokens, self.q, self.alts = self.tokens[n:], self.q[n:], self.alts[n:]
        else:  # the cloud went elsewhere: everything drafted after the fork is useless
            self.tokens, self.q, self.alts, self.sent_to = [], [], [], None

    def adopt(self, block: Block, committed_since: list[int]) -> bool:
        """Starts as the part of ``block`` (drafted after the committed prefix as it was then)
        past ``committed_since`` (what the cloud committed while it drafted), none of it sent,
        where the block begins with those tokens and nothing else was drafted meanwhile.
        Whether anything is left to send."""
        n = len(committed_since)
        if self.tokens or block.tokens[:n] != committed_since or n >= len(block.tokens):
            return False
        q = block.q if block.q is not None else [None] * len(block.tokens)
        self.tokens, self.q, self.sent_to = block.tokens[n:], q[n:], None
        self.alts = [None] * len(self.tokens)
        return True

    def restart(self, tokens: list[int], alts: list[Alternative | None]) -> None:
        """From tokens drafted already after the committed prefix (a branch's), none of them
        sent as this speculation: its next Draft is a full one."""
        self.tokens, self.q, self.alts, self.sent_to = tokens, [None] * len(tokens), alts, None


@dataclass
class _Branch:
    """A branch: the draft's second choice at sequence index ``pos`` after ``prefix`` (the
    committed prefix and the speculation then), and the draft's continuation after it."""

    pos: int
    prefix: list[int]
    tokens: list[int]  # the second choice first
    alts: list[Alternative | None]  # the draft's second choice after each of ``tokens``
    sent_at: float | None = None  # when its Draft left (None: still being drafted)
    round: int = 0  # its Draft's round

    @property
    def sequence(self) -> list[int]:
        return [*self.prefix, *self.tokens]


class _Branches:
    """Branch-ahead drafts of a greedy cloud-led speculation (module docstring): the one being
    drafted, the ones sent whose position is not passed yet, and the positions tried."""

    def __init__(self, enabled: bool, limit: int) -> None:
        self.enabled, self.limit = enabled, limit
        self.building: _Branch | None = None
        self.sent: list[_Branch] = []
        self.rounds: set[int] = set()  # the rounds of the branch Drafts sent (the last SENT_KEPT)
        self.count = 0  # branch Drafts sent
        self.tried: set[tuple[int, int]] = set()  # (position, second choice) branched

    def pick(self, committed: Committed, spec: _Speculation, skip: int) -> _Branch | None:
        """A new branch at the earliest position at least ``skip`` past committed_len where the
        draft is unsure and not branched yet, with room for a token after its second choice
        within a Draft of ``limit``; None: no such position, or BRANCHES held already."""
        n = len(committed)
        if len(self.sent) >= BRANCHES:
            return None
        for i in range(skip, min(len(spec.tokens), self.limit - 1)):
            alt = spec.alts[i]
            if alt is None or alt.p_top >= UNSURE or (n + i, alt.token) in self.tried:
                continue
            self.tried.add((n + i, alt.token))
            prefix = [*committed.tokens, *spec.tokens[:i]]
            return _Branch(n + i, prefix, [alt.token], [None])
        return None

    def full(self, branch: _Branch, committed_len: int) -> bool:
        """Holds BRANCH_TOKENS, or as many as a Draft of ``limit`` from committed_len takes."""
        room = self.limit - (branch.pos - committed_len)
        return len(branch.tokens) >= min(BRANCH_TOKENS, room)

    def live(self, branch: _Branch, committed: Committed, spec: _Speculation) -> bool:
        """Its position is not committed yet and the speculation still holds its prefix."""
        n = len(committed)
        main = [*committed.tokens, *spec.tokens[: branch.pos - n]]
        return branch.pos >= n and main == branch.prefix

    def corrected(self, committed: Committed, token: int, came: float) -> _Branch | None:
        """The branch sent before ``came`` whose second choice is the correction ``token`` that
        ends ``committed`` now, after the same prefix; None: no such branch."""
        pos = len(committed) - 1
        for b in self.sent:
            at = b.pos == pos and b.tokens[0] == token and b.sent_at < came
            if at and b.prefix == committed.tokens[:pos]:
                return b
        return None

    def adopt(self, committed: Committed) -> _Branch | None:
        """A branch (sent or being drafted) the committed prefix took and that holds tokens
        after it: the speculation restarts from them."""
        n = len(committed)
        for b in [*self.sent, *([self.building] if self.building else [])]:
            seq = b.sequence
            if b.pos < n < len(seq) and seq[:n] == committed.tokens:
                if b is self.building:
                    self.building = None
                return b
        return None

    def prune(self, committed_len: int) -> None:
        """Forgets the branches whose position the committed prefix passed."""
        self.sent = [b for b in self.sent if b.pos >= committed_len]
        if self.building is not None and self.building.pos < committed_len:
            self.building = None
        self.tried = {t for t in self.tried if t[0] >= committed_len}


class _Reach:
    """How far ahead to speculate: the tokens the cloud commits while a Draft is on its way
    (measured: committed_len at use minus the Draft's base_len), plus twice the positions worth
    verifying (while the measured chance that all before them are accepted stays >= MIN_REACH;
    at most max_draft_tokens and the cloud's hint): once for the step that uses the Draft, once
    more for the step after it, which starts before the edge hears of the first and can extend
    it.

    Until a Draft was verified the lag is estimated from Start's round trip over the cloud's
    time per committed token (Started.step_ms, then the Verdicts' spacing here). A Draft
    arriving lag tokens after its base is verified only where its first lag tokens are the ones
    the cloud committed meanwhile and it holds more: where lag reaches past every position
    worth verifying (``out_of_reach``), no Draft can pay: the edge then drafts nothing, and the
    cloud steps as in cloud-only (at RTT 500-1000 ms on the 2-core CPU every Draft came stale,
    docs/benchmarks-rtt0-500-1000-t0-cloud-only-auto-auto-warm.md).

    Out of reach only by what the acceptance measured (the lag is under the max_draft_tokens a
    speculation reaches before any Draft was verified), the edge probes: after PROBE_AFTER
    Verdicts idle it drafts again, until a Verdict verifies a Draft of its own (which measures
    acceptance and lag afresh) or PROBE_VERDICTS pass; a probe that got nothing verified doubles
    the wait before the next."""

    MIN_REACH = 0.1

    def __init__(
        self,
        max_draft_tokens: int,
        limit: int,
        acceptance: DraftLength | None = None,
        sent: int = 0,
        rtt_ms: float | None = None,
        step_ms: float = 0.0,
    ):
        self.max_draft_tokens, self.limit = max_draft_tokens, limit
        self.acceptance = acceptance or DraftLength(max_draft_tokens)
        self.rtt_ms = rtt_ms
        self.token_ms = step_ms if step_ms > 0 else None  # the cloud's time per committed token
        self.lag: float = self._travel()
        self.measured = False  # a verified Draft measured the lag itself
        self._since: float | None = None  # the first Verdict (s), and tokens committed after it
        self._counted = 0
        self.sent = sent  # tokens sent before the first verdict (a lead block): reach past them
        self.idle = 0  # Verdicts out of reach since drafting last stopped
        self.probe_after = PROBE_AFTER
        self.probing = 0  # Verdicts left in a probe (drafting although out of reach)

    def _travel(self) -> float:
        """Tokens the cloud commits in a round trip, by time; 0 while either is unknown."""
        if self.rtt_ms is None or not self.token_ms:
            return 0.0
        return self.rtt_ms / self.token_ms

    def observe(
        self, offset: int | None, verified: int, accepted: int, at: float = 0.0, tokens: int = 0
    ) -> None:
        """One Verdict: ``offset`` the cloud's progress while its Draft travelled (None: no
        Draft of ours verified); ``at`` when it came (s) and the ``tokens`` it commits."""
        if offset is not None:
            self.lag = 0.8 * self.lag + 0.2 * offset if self.measured else float(offset)
            self.measured = True
        self._pace(at, tokens)
        if verified:
            self.acceptance.observe(verified, accepted, 0.0)
        self.sent = 0
        self._probe(verified_ours=offset is not None)

    def _probe(self, verified_ours: bool) -> None:
        """After a Verdict: starts, ends or counts down a probe (class docstring)."""
        if verified_ours:  # measured afresh: a probe, if any, is over
            self.idle, self.probing, self.probe_after = 0, 0, PROBE_AFTER
            return
        if self.probing:
            self.probing -= 1
            if not self.probing:
                self.probe_after *= 2  # nothing verified: longer until the next
            return
        if not self._beyond() or self.unreachable():
            self.idle = 0
            return
        self.idle += 1
        if self.idle >= self.probe_after:
            self.idle, self.probing = 0, PROBE_VERDICTS

    def _pace(self, at: float, tokens: int) -> None:
        """The cloud's time per committed token from the Verdicts' spacing since the first
        (Verdicts read together arrive together: a mean over all of them, not per Verdict)."""
        if self._since is None:
            self._since = at
            return
        self._counted += tokens
        if self._counted >= PACE_TOKENS and at > self._since:
            self.token_ms = (at - self._since) * 1e3 / self._counted
            if not self.measured:
                self.lag = self._travel()

    def reachable(self) -> int:
        """Positions after a Draft's base worth verifying: while the measured chance that all
        before them are accepted stays >= MIN_REACH (the acceptance past max_draft_tokens taken
        as at max_draft_tokens), at most ``limit``; max_draft_tokens while nothing was measured
        (the prior alone would stop drafting at a few tokens of lag, before a Draft could show
        what it reaches)."""
        if not self.acceptance.tried.any():
            return self._unmeasured_reach()
        alphas = self.acceptance.alphas()  # [max_draft_tokens]
        alphas = np.concatenate([alphas, np.full(max(0, self.limit - len(alphas)), alphas[-1])])
        return int(np.sum(np.cumprod(alphas[: self.limit]) >= self.MIN_REACH))

    def _unmeasured_reach(self) -> int:
        return min(self.max_draft_tokens, self.limit)

    def unreachable(self) -> bool:
        """Out of reach whatever the acceptance: the lag is at least what a speculation with
        nothing measured reaches (no probe then)."""
        return self.lag >= self._unmeasured_reach()

    def out_of_reach(self) -> bool:
        return not self.probing and self._beyond()

    def _beyond(self) -> bool:
        return self.lag >= self.reachable()

    def first(self, want: int) -> int:
        """The part of ``want`` the next step verifies: the lag and one reach of two."""
        lag = round(self.lag)
        return min(want, lag + max(1, (want - lag + 1) // 2))

    def want(self, hint: int) -> int:
        if not self.acceptance.tried.any():  # nothing verified yet: as far as allowed
            return min(self.limit, round(self.lag) + self.sent + min(self.max_draft_tokens, hint))
        reach = np.cumprod(self.acceptance.alphas()) >= self.MIN_REACH
        useful = 1 + int(np.argmin(reach)) if not reach.all() else self.max_draft_tokens
        return min(self.limit, round(self.lag) + 2 * min(self.max_draft_tokens, hint, useful))


def _reach_of(
    plan: SessionPlan, started: pb.Started, rtt_ms: float | None, handover: Handover | None = None
) -> _Reach | None:
    """A stream's reach from its Started (Start's round trip ``rtt_ms``, the cloud's step and
    block limit) and a lock-step ``handover``'s measurements; None for a fixed k, which drafts
    whatever the link."""
    if not plan.adaptive:
        return None
    limit = started.limits.max_draft_tokens
    lead = (handover.acceptance, len(handover.block.tokens)) if handover else (None, 0)
    k = min(plan.max_draft_tokens, limit)
    return _Reach(k, limit, *lead, rtt_ms, started.step_ms)


def reaches(plan: SessionPlan, started: pb.Started, rtt_ms: float | None) -> bool:
    """Whether a cloud-led speculation of ``plan`` can reach the cloud on the link Started
    measured: False where the round trip is more target steps than any speculation holds
    (``_Reach.unreachable``), so that no Draft of the stream would ever be verified."""
    reach = _reach_of(plan, started, rtt_ms)
    return reach is None or not reach.unreachable()


async def cloud_led_rounds(
    stream: Stream,
    committed: Committed,
    proposer: Proposer,
    rule: DraftRule,
    plan: SessionPlan,
    started: pb.Started,
    handover: Handover | None = None,
    early: Worker | None = None,
    early_k: int = 0,
) -> AsyncIterator[list[int]]:
    """From Started, or from a lock-step stream's ``handover``: the speculation then starts as
    the lead block and reaches past it, with the acceptance the lock-step rounds measured, while
    the cloud verifies it, instead of waiting for that verdict. ``early``: the block (Block, ms)
    being drafted after the prompt since Start (edge.rounds); the speculation starts as what of
    it the cloud has not committed otherwise by the time it is done, sent at once; ``early_k``:
    its length (0: not known, the block runs out). Once the cloud has committed that many tokens
    on its own (a draft that loaded late: a new process's session is ready ~0.4 s after its
    request on the 2-core CPU, ten target steps), the block holds nothing the cloud still needs:
    its prefill, the draft's cache, goes on, its draft steps do not (they cost ~15 ms each
    before the speculation could start from what the cloud committed)."""
    stats = stream.stats
    max_draft_tokens = min(plan.max_draft_tokens, started.limits.max_draft_tokens)
    reach = _reach_of(plan, started, stats.start_rtt_ms, handover)
    verdicts: asyncio.Queue = asyncio.Queue()
    led = handover.led if handover is not None else None
    if led is not None:
        verdicts.put_nowait((led, time.perf_counter()))
    over = led is not None and led.finished  # the final Verdict, read already: none to receive
    receiver = asyncio.create_task(asyncio.sleep(0) if over else _receive(stream, verdicts))
    spec = _Speculation(handover.block if handover else None, len(committed))
    drafts = _Drafts(stream, committed, started, handover)
    greedy = rule.sampling.greedy and not drafts.rejection
    branches = _Branches(greedy and stream.cfg.branch_ahead, started.limits.max_draft_tokens)
    draw = proposer.next_token_with_alternative if branches.enabled else _no_alternative(proposer)
    paused, hint = 0, max_draft_tokens
    after_rejection = False  # the previous Verdict corrected a draft
    sent_at: float | None = None  # when the first Draft after the last correction left
    stale_from = 0  # Verdict.drafts_dropped when drafting last (re)started
    remaining = handover.remaining if handover is not None else started.max_new_tokens
    t_prev = time.perf_counter()
    worker: Worker | None = early
    prefix = list(committed.tokens)  # what the worker drafts after ...
    feeds = 0  # ... and the tokens of it its pass forwards first (uncached)
    getter: asyncio.Future | None = None
    try:
        while True:
            ahead = reach.want(hint) if reach else min(max_draft_tokens, hint)
            want = max(0, min(ahead, remaining - 1))
            # No Draft can be verified while the cloud commits past the speculation's reach
            # before one arrives: the edge drafts nothing then, as if paused.
            idle = paused != 0 or (reach is not None and reach.out_of_reach())
            # Branches once the speculation reaches what the next step verifies; the
            # speculation on to ``want`` after them.
            first = want if reach is None else reach.first(want)
            if worker is None and not idle:
                after: list[int] | None = None
                if len(spec.tokens) >= first and branches.enabled and len(spec.tokens) > 1:
                    skip = int(reach.lag) if reach else 0
                    if branches.building is None:
                        branches.building = branches.pick(committed, spec, skip)
                    if branches.building is not None:
                        after = branches.building.sequence
                if after is None and len(spec.tokens) < want:
                    after = [*committed.tokens, *spec.tokens]
                if after is not None:
                    # read while no worker runs, so the draft's cache holds still
                    prefix, feeds = after, proposer.feeds(after)
                    worker = Worker(draw, prefix, rule)
            getter = getter or asyncio.ensure_future(verdicts.get())
            waits = {getter} if worker is None else {getter, worker.future}
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if worker is not None and worker is early and worker.future.done():
                try:
                    block, _ = await worker.result()
                except Stopped:  # stopped below: the cloud committed past it
                    block = None
                worker = early = None
                since = committed.tokens[len(prefix) :]  # committed while it drafted
                # Where no Draft can reach the cloud in time, it is not sent (only its prefill
                # is kept: the drafter's cache)
                sends = block is not None and not idle and spec.adopt(block, since)
                if sends and not await drafts.send(spec):
                    paused = -1
            elif worker is not None and worker.future.done():
                try:
                    token, q, alt = await worker.result()
                except Stopped:  # cut short below: its token continued a rejected one
                    worker = None
                    continue
                worker = None
                if prefix == [*committed.tokens, *spec.tokens]:  # no verdict moved it meanwhile
                    spec.add(token, q, alt)
                    leaves = time.perf_counter()
                    if not await drafts.send(spec):
                        paused = -1  # no more drafting on this stream
                    elif sent_at is None:
                        sent_at = leaves
                elif (b := branches.building) is not None and prefix == b.sequence:
                    grown = await _grow(b, token, alt, branches, drafts, committed, spec)
                    paused = paused if grown else -1
            if not getter.done():
                continue
            ready, getter = [getter.result()], None
            while not verdicts.empty():
                ready.append(verdicts.get_nowait())
            for item in ready:
                if isinstance(item, Exception):
                    raise item
                v, came = item
                now = time.perf_counter()
                chunk, offset = drafts.apply(v)
                step = stats.observe_round(v, (now - t_prev) * 1e3, draft_ms=0.0)
                stats.observe_pass(CLOUD_LED, len(chunk), (now - t_prev) * 1e3)
                # The cloud led before a lead Draft of ours reached it (or led us: edge.lockstep)
                stats.observe_lead(0, by_cloud=v.led)
                # Had a Draft after the correction left before this Verdict came? (Drafts sent
                # before the correction was read were drafted after the rejected token.)
                sent = sent_at is not None and sent_at < came
                branch = step.drafted > 0 and v.round in branches.rounds
                stats.observe_cloud_led_pass(step, after_rejection, sent, branch)
                after_rejection = v.has_token and step.accepted < step.drafted
                if after_rejection:
                    sent_at = None
                    branched = branches.corrected(committed, v.token, came) is not None
                    stats.observe_correction(branched)
                if reach is not None:
                    reach.observe(offset, step.drafted, step.accepted, now, len(chunk))
                t_prev = now
                spec.consume(chunk)
                if not spec.tokens and (b := branches.adopt(committed)) is not None:
                    n = len(committed) - len(b.prefix)  # the branch's tokens now committed
                    spec.restart(b.tokens[n:], b.alts[n:])
                branches.prune(len(committed))
                remaining -= len(chunk)
                if v.HasField("max_draft_tokens_hint") and plan.follow_hint:
                    hint = v.max_draft_tokens_hint
                    stats.observe_hint(hint)
                before, paused = paused, _pause(stats, paused, v.drafts_dropped - stale_from)
                if before and not paused:  # drafting resumes: stale Drafts count afresh
                    stale_from = v.drafts_dropped
                yield chunk
                if v.finished:
                    return
            # The first block once the cloud committed its length on its own (docstring): no
            # interrupt, which would cut its prefill short too.
            if (
                worker is not None
                and worker is early
                and 0 < early_k <= len(committed) - len(prefix)
            ):
                worker.stop.set()
            # A token being drafted after what a Verdict just rejected is no use: stop its pass
            # now rather than after it (~one draft step sooner to draft after the correction);
            # one the cloud committed past, nothing rejected, runs on where it catches up.
            if worker is not None and worker is not early and not worker.stop.is_set():
                building = branches.building
                holds = [*committed.tokens, *spec.tokens]
                catches_up = feeds >= CATCH_UP and holds[: len(prefix)] == prefix
                if (
                    prefix != holds
                    and not catches_up
                    and (building is None or prefix != building.sequence)
                ):
                    worker.stop.set()
                    proposer.interrupt()
                    stats.observe_interrupt()
    finally:
        if getter is not None:
            getter.cancel()
        if worker is not None:
            await worker.join()
        receiver.cancel()
        stats.observe_drafts_sent(drafts.delivered, branches.count)


def _no_alternative(proposer: Proposer):
    """``proposer.next_token`` in the shape of next_token_with_alternative (no branching)."""

    def draw(committed, rule, stop=None):
        return (*proposer.next_token(committed, rule, stop), None)

    return draw


async def _grow(
    branch: _Branch,
    token: int,
    alt: Alternative | None,
    branches: _Branches,
    drafts: _Drafts,
    committed: Committed,
    spec: _Speculation,
) -> bool:
    """Adds the draft's next token to the branch being drafted; once it is full, sends it, then
    the speculation again in full (the freshest Draft, and the one its next token continues).
    A branch whose position the committed prefix passed, or whose prefix the speculation no
    longer holds, is dropped. False: the stream takes no more Drafts."""
    branches.building = None
    if not branches.live(branch, committed, spec):
        return True
    branch.tokens.append(token)
    branch.alts.append(alt)
    if not branches.full(branch, len(committed)):
        branches.building = branch
        return True
    n = len(committed)
    room = branches.limit - (branch.pos - n)
    branch.tokens, branch.alts = branch.tokens[:room], branch.alts[:room]
    if not await drafts.send_branch(branch):
        return False
    branch.sent_at = time.perf_counter()
    branches.sent.append(branch)
    branches.count += 1
    branches.rounds = {r for r in branches.rounds if r > branch.round - SENT_KEPT}
    branches.rounds.add(branch.round)
    spec.sent_to = None  # a full Draft
    return await drafts.send(spec)


async def _receive(stream: Stream, verdicts: asyncio.Queue) -> None:
    """Reads the stream's Verdicts into ``verdicts`` while the loop drafts."""
    try:
        while True:
            v = await stream.recv("verdict")
            verdicts.put_nowait((v, time.perf_counter()))
            if v.finished:
                return
    except Exception as e:  # handed to the loop, which raises it
        verdicts.put_nowait(e)


class _Drafts:
    """The Drafts sent (round -> base_len and tokens, the last SENT_KEPT) to read Verdicts
    against, and the round of the last one."""

    def __init__(
        self,
        stream: Stream,
        committed: Committed,
        started: pb.Started,
        handover: Handover | None,
    ):
        self.stream, self.committed = stream, committed
        self.rejection = started.verification == pb.VERIFICATION_RULE_REJECTION
        self.q_counts = started.q_counts
        self.round = handover.round if handover is not None else 0
        self.delivered = 0  # Drafts these rounds sent (a handover's lead Draft not counted)
        self.sent: dict[int, tuple[int, list[int]]] = {}
        self.unlagged: int | None = None  # the round sent with Start: no lag to measure
        if handover is not None:
            self.sent[handover.round] = (len(committed), list(handover.block.tokens))
            self.unlagged = handover.round if handover.with_start else None

    async def send(self, spec: _Speculation) -> bool:
        """Sends the speculation's new tokens as a continuation of its last Draft while some of
        that one is still uncommitted, else all of it from committed_len. False: the stream
        takes no more Drafts."""
        committed = len(self.committed)
        round_no = self._next_round(committed, spec.tokens)
        continues = spec.sent_to is not None and spec.sent_to > committed
        base = spec.sent_to if continues else committed
        tokens = spec.tokens[base - committed :]
        draft = pb.Draft(round=round_no, base_len=base, tokens=tokens, continues=continues)
        if self.rejection:
            draft.q.extend(sparse_to_pb(q, self.q_counts) for q in spec.q[base - committed :])
        spec.sent_to = committed + len(spec.tokens)
        return await self._deliver(draft)

    async def send_branch(self, branch: _Branch) -> bool:
        """Sends a branch as a full Draft from committed_len (greedy: no q); False: the stream
        takes no more Drafts."""
        committed = len(self.committed)
        tokens = branch.sequence[committed:]
        branch.round = self._next_round(committed, tokens)
        draft = pb.Draft(round=branch.round, base_len=committed, tokens=tokens, branch=True)
        return await self._deliver(draft)

    def _next_round(self, committed_len: int, tokens: list[int]) -> int:
        """A new Draft's round, remembered with what it holds from ``committed_len`` (the last
        SENT_KEPT) to read its Verdict against."""
        self.round += 1
        self.sent[self.round] = (committed_len, list(tokens))
        self.sent.pop(self.round - SENT_KEPT, None)
        return self.round

    async def _deliver(self, draft: pb.Draft) -> bool:
        try:
            await self.stream.send(pb.ClientMessage(draft=draft))
        except grpc.aio.AioRpcError:
            # The server may end the call (its final verdict) while a Draft is on its way:
            # Drafts are optional, the verdicts tell what happened.
            return False
        self.delivered += 1
        return True

    def apply(self, v: pb.Verdict) -> tuple[list[int], int | None]:
        """Commits a Verdict; returns its chunk and how many tokens the cloud committed while
        its Draft was on the way (None: not known, or a Draft sent with Start)."""
        n = len(self.committed)
        known = v.round in self.sent and v.round != self.unlagged
        offset = n - self.sent[v.round][0] if known else None
        base, tokens = self.sent.get(v.round, (n, []))
        chunk = tokens[n - base : n - base + v.accepted] + ([v.token] if v.has_token else [])
        self.committed.commit(chunk, v)
        return chunk, offset


def _pause(stats, paused: int, dropped: int) -> int:
    """Verdicts to go without drafting; ``dropped``: Drafts the cloud dropped as stale since
    drafting last (re)started."""
    if paused < 0:  # the stream can no longer take Drafts
        return paused
    if paused:
        return paused - 1
    if stats.drafted >= 4 * PAUSE_VERDICTS and stats.acceptance_rate < PAUSE_BELOW:
        return PAUSE_VERDICTS
    if stats.drafted == 0 and dropped >= PAUSE_STALE:  # every Draft came too late
        return PAUSE_VERDICTS
    return 0
