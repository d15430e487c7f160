"""Cloud-led rounds on the edge (DESIGN §7): draft ahead continuously, never hold the cloud up.

The cloud streams one Verdict per target step whether or not Drafts arrive. Here the edge keeps
a speculation: its own draft tokens after the committed prefix, extended one token at a time in
a worker thread. Every few new tokens it sends what the cloud has not seen of the speculation:
the whole of it from its latest known committed_len after a restart, else only the new tokens as
a continuation (Draft.continues) of the Draft before; the cloud verifies the part it has not
committed yet. A Verdict that agrees
with the speculation consumes its head; one that does not restarts it from the committed prefix.

Draft randomness is the session's shared numbers at each position (shared/coupling.py), so a
token drafted twice after the same prefix is the same token (a speculation rebuilt after a Verdict
equals the one drafted before it), and where the cloud draws a position itself, with no Draft
there, it often draws the token the speculation holds, which keeps the speculation after it
alive at T > 0.
Drafting pauses when it does not pay (almost nothing accepted); the cloud streams on regardless.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator

import grpc
import numpy as np

from specsplit.edge.adaptive import DraftLength
from specsplit.edge.drafting import Block, draw_next, next_logits
from specsplit.edge.session import Session
from specsplit.edge.worker import Stoppable, Worker
from specsplit.shared.protocol import pb, sparse_to_pb

PAUSE_BELOW = 0.1  # acceptance under which drafting pauses ...
PAUSE_VERDICTS = 32  # ... for this many verdicts, then tries again
SENT_KEPT = 64  # Drafts remembered to read Verdicts against


class _Speculation:
    """Draft tokens (and their q) after the committed prefix; ``unsent`` not in a Draft yet."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.q: list = []
        self.unsent = 0
        self.sent_to: int | None = None  # where the last Draft of this speculation ended

    def consume(self, chunk: list[int]) -> None:
        if self.tokens[: len(chunk)] == chunk:
            self.tokens, self.q = self.tokens[len(chunk) :], self.q[len(chunk) :]
            self.unsent = min(self.unsent, len(self.tokens))
        else:  # the cloud went elsewhere: everything drafted after the fork is useless
            self.tokens, self.q, self.unsent, self.sent_to = [], [], 0, None


def _draft_one(s: Session, seq: list[int], stop: threading.Event):
    """One draft token after ``seq`` and the q it was sampled from (None when greedy)."""
    cfg = s.cfg
    logits = next_logits(Stoppable(s.drafter, stop), seq)
    return draw_next(logits, len(seq), cfg.sampling, s.noise, cfg.q_entries, cfg.q_levels)


class _Reach:
    """How far ahead to speculate: the tokens the cloud commits while a Draft is on its way
    (measured: committed_len at use minus the Draft's base_len), plus twice the positions worth
    verifying (while the measured chance that all before them are accepted stays >= MIN_REACH;
    at most k_max and the cloud's hint): once for the step that uses the Draft, once more for
    the step after it, which starts before the edge hears of the first and can extend it."""

    MIN_REACH = 0.1

    def __init__(
        self, k_max: int, limit: int, acceptance: DraftLength | None = None, sent: int = 0
    ):
        self.k_max, self.limit = k_max, limit
        self.acceptance = acceptance or DraftLength(k_max)
        self.lag: float = 0.0
        self.sent = sent  # tokens sent before the first verdict (a lead block): reach past them

    def observe(self, offset: int | None, verified: int, accepted: int) -> None:
        if offset is not None:
            self.lag = 0.8 * self.lag + 0.2 * offset
        if verified:
            self.acceptance.observe(verified, accepted, 0.0)
        self.sent = 0

    def want(self, hint: int) -> int:
        if not self.acceptance.tried.any():  # nothing verified yet: as far as allowed
            return min(self.limit, self.sent + min(self.k_max, hint))
        reach = np.cumprod(self.acceptance.alphas()) >= self.MIN_REACH
        useful = 1 + int(np.argmin(reach)) if not reach.all() else self.k_max
        return min(self.limit, round(self.lag) + 2 * min(self.k_max, hint, useful))


async def cloud_led_rounds(
    s: Session,
    started: pb.Started,
    remaining: int | None = None,
    rounds_before: int = 0,
    lead: Block | None = None,
    acceptance: DraftLength | None = None,
) -> AsyncIterator[list[int]]:
    """From Started, or from a lock-step session's Draft.lead (round ``rounds_before``, the
    block ``lead``, sent from the committed prefix with ``remaining`` tokens to go) with the
    acceptance its rounds measured: the speculation then reaches past the lead block while the
    cloud verifies it, instead of waiting for that verdict."""
    cfg, stats = s.cfg, s.stats
    k_max = min(cfg.draft_tokens, started.limits.max_draft_tokens)
    limit = started.limits.max_draft_tokens
    sent_first = len(lead.tokens) if lead is not None else 0
    reach = _Reach(k_max, limit, acceptance, sent_first) if cfg.adapts else None
    send_every = max(1, k_max // 2)
    rejection = started.verification == pb.VERIFICATION_MODE_REJECTION
    verdicts: asyncio.Queue = asyncio.Queue()

    async def receive() -> None:
        try:
            while True:
                v = await s.recv("verdict")
                verdicts.put_nowait(v)
                if v.finished:
                    return
        except Exception as e:  # handed to the loop below, which raises it
            verdicts.put_nowait(e)

    receiver = asyncio.create_task(receive())
    spec = _Speculation()
    sent: dict[int, tuple[int, list[int]]] = {}  # round -> (base_len, tokens)
    if lead is not None:  # the speculation so far, sent already
        spec.tokens, spec.q = list(lead.tokens), list(lead.q or [None] * len(lead.tokens))
        spec.sent_to = len(s.committed) + len(lead.tokens)
        sent[rounds_before] = (len(s.committed), list(lead.tokens))
    round_no, paused, hint = rounds_before, 0, k_max
    remaining = started.max_new_tokens if remaining is None else remaining
    t_prev = time.perf_counter()
    worker: Worker | None = None
    getter: asyncio.Future | None = None
    try:
        while True:
            ahead = reach.want(hint) if reach else min(k_max, hint)
            want = max(0, min(ahead, remaining - 1))
            if worker is None and paused == 0 and len(spec.tokens) < want:
                prefix = [*s.committed, *spec.tokens]
                worker = Worker(_draft_one, s, prefix)
            getter = getter or asyncio.ensure_future(verdicts.get())
            waits = {getter} if worker is None else {getter, worker.future}
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if worker is not None and worker.future.done():
                token, q = await worker.result()
                worker = None
                if prefix == [*s.committed, *spec.tokens]:  # no verdict moved it meanwhile
                    spec.tokens.append(token)
                    spec.q.append(q)
                    spec.unsent += 1
                    if spec.unsent >= send_every or len(spec.tokens) >= want:
                        round_no += 1
                        sent[round_no] = (len(s.committed), list(spec.tokens))
                        sent.pop(round_no - SENT_KEPT, None)
                        try:
                            await _send_draft(s, started, spec, round_no, rejection)
                        except grpc.aio.AioRpcError:
                            # The server may end the call (its final verdict) while a Draft is
                            # on its way: Drafts are optional, the verdicts tell what happened.
                            paused = -1  # no more drafting on this stream
                            stats.drafts_sent -= 1
            if not getter.done():
                continue
            ready, getter = [getter.result()], None
            while not verdicts.empty():
                ready.append(verdicts.get_nowait())
            for v in ready:
                if isinstance(v, Exception):
                    raise v
                now = time.perf_counter()
                offset = len(s.committed) - sent[v.round][0] if v.round in sent else None
                chunk, verified = _apply(s, v, sent)
                if reach is not None:
                    reach.observe(offset, verified, v.accepted)
                s.observe(v, verified, 0.0, (now - t_prev) * 1e3)
                t_prev = now
                spec.consume(chunk)
                remaining -= len(chunk)
                if v.HasField("max_draft_tokens_hint") and cfg.follow_hint:
                    hint = v.max_draft_tokens_hint
                    stats.block_hint.append(hint)
                paused = _pause(stats, paused)
                yield chunk
                if v.finished:
                    return
    finally:
        if getter is not None:
            getter.cancel()
        if worker is not None:
            await worker.join()
        receiver.cancel()
        stats.drafts_sent += round_no - rounds_before


async def _send_draft(s: Session, started, spec: _Speculation, round_no: int, rejection) -> None:
    """Sends the speculation's new tokens as a continuation of its last Draft while some of
    that one is still uncommitted, else all of it from committed_len."""
    committed = len(s.committed)
    continues = spec.sent_to is not None and spec.sent_to > committed
    base = spec.sent_to if continues else committed
    draft = pb.Draft(
        round=round_no, base_len=base, tokens=spec.tokens[base - committed :], continues=continues
    )
    if rejection:
        draft.q.extend(sparse_to_pb(q, started.q_counts) for q in spec.q[base - committed :])
    spec.unsent = 0
    spec.sent_to = committed + len(spec.tokens)
    await s.send(pb.ClientMessage(draft=draft))


def _apply(s: Session, v: pb.Verdict, sent: dict) -> tuple[list[int], int]:
    """Commits a Verdict; returns its chunk and how many draft tokens its step verified."""
    base, tokens = sent.get(v.round, (len(s.committed), []))
    off = len(s.committed) - base
    chunk = tokens[off : off + v.accepted] + ([v.token] if v.has_token else [])
    s.committed += chunk
    return chunk, v.drafts_verified if v.round else 0


def _pause(stats, paused: int) -> int:
    if paused < 0:  # the stream can no longer take Drafts
        return paused
    if paused:
        return paused - 1
    if stats.drafted >= 4 * PAUSE_VERDICTS and stats.acceptance_rate < PAUSE_BELOW:
        return PAUSE_VERDICTS
    return 0
