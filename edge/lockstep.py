"""Lock-step rounds: draft k, send, wait for the verdict, commit (docs/design.md#lock-step).

The loop drafts through the stream's ``Proposer`` under its ``DraftRule`` and reads the session
plan; it sends and receives through the ``Stream`` and commits each verdict's chunk to the
``Committed`` sequence (edge.sequence) that edge.rounds hands it. While a verdict is in flight
the next block is drafted for "all accepted, bonus = the draft's guess"
(``Proposer.guess_next``) and used when the verdict matches (docs/design.md#performance).
k is chosen per round by ``edge.adaptive.DraftLength`` unless the plan fixes it. In session
mode ``auto`` the rounds also measure whether cloud-led would be faster (``edge.mode_switch``);
once it would, the next Draft carries ``lead`` and the loop ends with a ``Handover``
(edge.handover): the dispatcher (edge.rounds) goes on with cloud-led rounds at once, that Draft
the first of their speculation (the cloud starts stepping without waiting as soon as it reads
it).
The cloud may take that lead itself when the first Draft is late (Start.follows_lead, which
edge.rounds sets for such a plan): its first Verdict then says so (Verdict.led), is a cloud-led
step's, and the loop ends with a Handover that carries it: cloud-led rounds go on from it, the
Draft sent one of their Drafts.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from specsplit.edge.adaptive import DraftLength
from specsplit.edge.drafting import Block, DraftRule
from specsplit.edge.handover import Handover
from specsplit.edge.mode_switch import LOCK_STEP, LeadChoice
from specsplit.edge.proposer import Proposer, block_off_loop, draft_ahead
from specsplit.edge.sequence import Committed
from specsplit.edge.session_plan import SessionPlan
from specsplit.edge.stream import Stream
from specsplit.edge.worker import Worker
from specsplit.shared.protocol import pb, sparse_to_pb


async def lockstep_rounds(
    stream: Stream,
    committed: Committed,
    proposer: Proposer,
    rule: DraftRule,
    plan: SessionPlan,
    started: pb.Started,
    first: tuple[Block, float] | None,
    reading: asyncio.Future | None = None,
    sent: bool = False,
) -> AsyncIterator[list[int] | Handover]:
    """Each round's committed chunk from Started, or, last, the Handover to cloud-led rounds;
    ``first``: the first block and its drafting time (ms), drafted early; ``reading``: the read
    of the first Verdict, already under way (edge.rounds reads a lead of the cloud's while the
    first block drafts): the first round's Verdict, and its first Draft does not lead;
    ``sent``: ``first`` left already as round 1's Draft, whole and not leading (edge.rounds
    sends a cloud-led stream's first block before Started; a server may run lock-step)."""
    stats = stream.stats
    max_draft_tokens = min(plan.max_draft_tokens, started.limits.max_draft_tokens)
    chooser = DraftLength(max_draft_tokens) if plan.adaptive else None
    switch = LeadChoice(max_draft_tokens, rule.sampling.greedy, plan.led) if plan.may_lead else None
    t_prev = time.perf_counter()  # the last verdict (Started at first): a lock-step cycle
    remaining = started.max_new_tokens
    round_no = 0
    hint = max_draft_tokens  # the cloud's largest wanted block, updated by every verdict
    k = max_draft_tokens
    while True:
        round_no += 1
        # A round emits up to k + 1 tokens: never draft past the length limit.
        k = max(0, min(k, hint, remaining - 1))
        base_len = len(committed)
        fresh = first is None
        if first is not None:  # drafted early (prefill, or the previous verdict in flight)
            (block, draft_ms), first = first, None
            block = block if sent else block.head(k)
            k = len(block.tokens)  # shorter when the cloud's hint grew meanwhile
        else:
            block, draft_ms = await block_off_loop(proposer, committed.tokens, k, rule)
        t1 = time.perf_counter()
        # Hand over with this block when cloud-led would be faster (and blocks remain after it).
        lead = (
            switch is not None
            and not sent
            and reading is None  # the Verdict read already is this Draft's (or the cloud's lead)
            and remaining > k + 1
            and (plan.lead_first or switch.should_lead(k))
        )
        if not sent:
            await stream.send(_draft(started, round_no, base_len, block, lead))
        sent = False
        if lead:
            stats.observe_lead(round_no, by_cloud=False)
            yield Handover(round_no, block, remaining, switch.lengths)
            return
        # The next block's size is chosen now, before the verdict, so it can be drafted ahead.
        planned = chooser.choose(hint) if chooser else max_draft_tokens
        k_next = max(0, min(planned, hint, remaining - (k + 1) - 1))
        ahead = None
        if plan.draft_ahead and k > 0 and k_next > 0:
            seq = [*committed.tokens, *block.tokens]
            ahead = Worker(draft_ahead, proposer, seq, k_next, rule)
        v, t2, first = await _verdict(stream, k, ahead, reading)
        reading = None
        ahead_hit = first is not None
        if v.led:  # the cloud leads: v is a cloud-led step's, the block one of its Drafts
            stats.observe_lead(round_no, by_cloud=True)
            lengths = switch.lengths if switch is not None else DraftLength(max_draft_tokens)
            yield Handover(round_no, block, remaining, lengths, v)
            return
        chunk = block.tokens[: v.accepted] + ([v.token] if v.has_token else [])
        committed.commit(chunk, v)
        remaining -= len(chunk)
        round_ms = (t2 - t1) * 1e3
        stats.observe_round(v, round_ms, draft_ms)
        cycle_ms = (t2 - t_prev) * 1e3
        stats.observe_pass(LOCK_STEP, len(chunk), cycle_ms)
        stats.observe_lockstep_round(k if chooser is not None else None, ahead_hit)
        if plan.obeys_hint and v.HasField("max_draft_tokens_hint"):
            hint = v.max_draft_tokens_hint
            stats.observe_hint(hint)
        critical_ms = draft_ms if fresh else None  # a block drafted ahead hid its cost
        timings = v.timings
        if chooser is not None:
            chooser.observe(k, v.accepted, timings.verify_ms, round_ms, critical_ms)
        if switch is not None:
            switch.observe(
                k, v.accepted, cycle_ms, timings.verify_ms, timings.server_ms, draft_ms, critical_ms
            )
        t_prev = t2
        yield chunk
        if v.finished:
            return
        k = planned


def _draft(started: pb.Started, round_no: int, base_len: int, block: Block, lead: bool):
    draft = pb.Draft(round=round_no, base_len=base_len, tokens=block.tokens, lead=lead)
    if block.q is not None and started.verification == pb.VERIFICATION_RULE_REJECTION:
        draft.q.extend(sparse_to_pb(q, started.q_counts) for q in block.q)
    return pb.ClientMessage(draft=draft)


async def _verdict(stream: Stream, k: int, ahead: Worker | None, reading=None):
    """The verdict on a block of k (``reading``: its read, under way), when it came, and the
    block ``ahead`` drafted (with the time waited for it, ms) when the verdict matched its
    guess: all k accepted, bonus = guess."""
    try:
        v = await (reading if reading is not None else stream.recv("verdict"))
        t2 = time.perf_counter()
        if ahead is None or v.led:  # a cloud-led step's Verdict: not this block's
            return v, t2, None
        guess, next_block = await ahead.result()
        waited_ms = (time.perf_counter() - t2) * 1e3
        if v.accepted == k and v.has_token and v.token == guess and not v.finished:
            return v, t2, (next_block, waited_ms)  # only the wait is on the critical path
        return v, t2, None
    finally:
        if ahead is not None:  # the drafter must be idle before anyone else touches it
            await ahead.join()
