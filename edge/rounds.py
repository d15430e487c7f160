"""One stream's life, Start to Finished: the one place a session mode meets its loop.

Start asks for the plan's mode; the first block (lock-step's first Draft, or the start of a
cloud-led speculation) is drafted while the cloud prefills; Started settles the plan
(edge.session_plan) and brings the seed the draft rule needs. Where the
cloud may lead (Started.lead_after_ms), its first Verdict is read while that block drafts: a
cloud that led before the block was done (it measured a long round trip, docs/design.md#probe)
is followed at once, cloud-led from its Verdict, instead of after the drafting. Then the
loop of the mode the server runs takes the stream: ``lockstep_rounds`` (edge.lockstep),
``cloud_led_rounds`` (edge.cloud_led) or ``cloud_only_rounds`` (edge.cloud_only). The mode
switch is here too, one way: lock-step rounds that hand over end with a ``Handover``
(edge.handover), and cloud-led rounds go on from it. No loop calls another. A new mode is a new
loop module and a line here.

The stream's state that outlives one loop is made here and handed to each loop it runs: the
committed sequence (edge.sequence.Committed), opened from ``prompt``; the loops write the
generation's statistics through GenerationStats' methods. The ``Stream`` only transports.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence

import grpc

from specsplit.edge.adaptive import DraftLength
from specsplit.edge.cloud_led import cloud_led_rounds, reaches
from specsplit.edge.cloud_only import cloud_only_rounds
from specsplit.edge.drafting import Block, DraftRule
from specsplit.edge.handover import Handover
from specsplit.edge.lockstep import lockstep_rounds
from specsplit.edge.proposer import Proposer, block_off_loop, timed_block
from specsplit.edge.sequence import Committed
from specsplit.edge.session_plan import SessionPlan
from specsplit.edge.stream import SpecsplitError, Stream
from specsplit.edge.worker import Worker
from specsplit.shared.acceptance import VerificationRule
from specsplit.shared.protocol import pb, sparse_to_pb
from specsplit.shared.session_mode import SessionMode

log = logging.getLogger(__name__)

# An adaptive plan's first block, drafted while the cloud prefills, before any verdict measured
# acceptance or what rows cost. It is on the path to the first token twice: the edge drafts it
# after its own prefill (the cloud waits for it up to Started.lead_after_ms), and the cloud then
# verifies it in a pass of k + 1 rows. Where rows cost time (the CPU target: each row past the
# first ~0.27 of a one-row pass) and at the prior acceptance of 0.6 (edge/adaptive.py), the
# first round's gain over a one-row step, E(k) - 1 - 0.27 k in one-row passes, is best at k = 2-3
# and negative at 8; at 0.8 it is best at 4. Where rows are free (a GPU) 4 instead of 8 costs
# E(8) - E(4) = 0.2-1 token once. The rounds after it choose k from what they measured.
# Sent before Started (cloud-led), it is within any server's Limits: the protocol makes
# max_draft_tokens at least 4 (proto Limits).
FIRST_BLOCK = 4


async def run_rounds(
    stream: Stream, proposer: Proposer | None, plan: SessionPlan, prompt: Sequence[int]
) -> AsyncIterator[list[int]]:
    """Yields each round's committed chunk after ``prompt`` (after an outage, everything the
    generation committed so far); ``proposer`` None only when the plan is cloud-only."""
    cfg = stream.cfg
    committed = Committed(prompt)
    rule = None
    early = None
    drafts = proposer is not None and plan.mode is not SessionMode.CLOUD_ONLY
    fingerprint = proposer.tokenizer_fingerprint if drafts else None
    # Draft the first block (the draft's own prefill included) while the cloud prefills; a
    # sampled draft needs the seed first (SplitClient sends one: edge.client._own_seed). A
    # cloud-led stream's block leaves behind Start if done before Started (``_send_first``,
    # announced in Start.first_draft); else it is handed on to its rounds (``handed``), which
    # join it: its cloud steps on from the prefill without waiting, and a speculation begun only
    # at Started (a prefill on the edge, then tokens) left its first passes draftless (3-8 on
    # the 2-core CPU).
    k_first = _first_k(plan, stream.max_new_tokens)
    drafts_early = drafts and (stream.seed is not None or cfg.sampling.greedy)
    first_draft = drafts_early and plan.mode is SessionMode.CLOUD_LED and k_first > 0
    await stream.start(committed.tokens, plan.mode, fingerprint, plan.follows_lead, first_draft)
    if drafts_early:
        rule = _rule(stream, proposer, stream.seed)
        early = Worker(timed_block, proposer, committed.tokens, k_first, rule)
    reading = led = None  # the first Verdict's read while the block drafts; a lead it read
    handed = False
    sent: Block | None = None  # a cloud-led stream's first block, sent before Started came
    starting = asyncio.ensure_future(stream.started())
    try:
        if first_draft:
            sent = await _send_first(stream, early, starting, len(committed))
            early = None if sent is not None else early
        started = await starting
        plan = plan.settled(started, stream.stats.start_rtt_ms)
        stream.stats.led_at_start = plan.auto and plan.mode is SessionMode.CLOUD_LED
        if plan.mode.drafts and rule is None:
            rule = _rule(stream, proposer, started.seed)
        first = None
        led_next = plan.mode is SessionMode.CLOUD_LED or plan.lead_first
        if drafts and led_next and not reaches(plan, started, stream.stats.start_rtt_ms):
            # No later Draft of this stream can reach the cloud in time: a first block still
            # drafting (Started came first) stops (it would cost the device, and the cloud's
            # core beside it, for nothing)
            if early is not None:
                early.stop.set()
                proposer.interrupt()
                await early.join()
            early = None
            if plan.lead_first:  # lead at once, with no tokens
                first = (Block([], None), 0.0)
        if sent is not None and plan.mode is SessionMode.LOCK_STEP:
            first = (sent, 0.0)  # a server's right: lock-step, whose round 1 verifies it
        if first is not None or early is None or plan.mode is SessionMode.CLOUD_LED:
            pass  # nothing drafted early, or the cloud-led rounds draft on from it
        elif started.lead_after_ms > 0 and not plan.lead_first:
            first, reading, led = await _block_or_lead(stream, early)
        else:
            first = await early.result()
        if plan.mode is SessionMode.LOCK_STEP and first is None and led is None:
            k_first = _first_k(plan, started.max_new_tokens)
            first = await block_off_loop(proposer, committed.tokens, k_first, rule)
        if plan.mode is not SessionMode.CLOUD_ONLY:
            _check_pair(proposer, started.model)
        handed = early is not None and plan.mode is SessionMode.CLOUD_LED
    finally:
        starting.cancel()  # done already, unless something failed before Started came
        # the drafter must be idle before anyone else uses it (a handed block: the rounds')
        if early is not None and not handed:
            await early.join()
    early_led = early if handed else None
    mode, handover = plan.mode, None
    k = min(plan.max_draft_tokens, started.limits.max_draft_tokens)
    if sent is not None and mode is SessionMode.CLOUD_LED:  # its Verdict comes to those rounds
        handover = Handover(1, sent, started.max_new_tokens, DraftLength(k), with_start=True)
    if led is not None:  # the cloud leads before any Draft: cloud-led from its first Verdict
        stream.stats.observe_lead(0, by_cloud=True)
        empty = Block([], None)
        mode, handover = (
            SessionMode.CLOUD_LED,
            Handover(0, empty, started.max_new_tokens, DraftLength(k), led),
        )
    while True:
        if mode is SessionMode.CLOUD_ONLY:
            rounds = cloud_only_rounds(stream, committed)
        elif mode is SessionMode.CLOUD_LED:
            rounds = cloud_led_rounds(
                stream, committed, proposer, rule, plan, started, handover, early_led, k_first
            )
            early_led = None  # the rounds join it, whatever happens to them
        else:
            rounds = lockstep_rounds(
                stream, committed, proposer, rule, plan, started, first, reading, sent is not None
            )
        handover = None
        async with contextlib.aclosing(rounds):  # closed with the stream, even mid-loop
            async for out in rounds:
                if isinstance(out, Handover):
                    handover = out
                else:
                    yield out
        if handover is None:
            break
        mode = SessionMode.CLOUD_LED
    try:
        await stream.finish(len(committed))
    except grpc.aio.AioRpcError as e:
        # Every token arrived with the final Verdict, which agreed; only the goodbye was lost.
        log.info("the stream ended after its final Verdict, before Finished: %s", e.details())
        if not stream.stats.finish:
            stream.stats.observe_finished(committed.final)


def _first_k(plan: SessionPlan, max_new_tokens: int) -> int:
    """The first block's size: FIRST_BLOCK at most where k adapts, else the plan's fixed k;
    never past the length limit (a round emits up to k + 1 tokens)."""
    k = min(plan.max_draft_tokens, FIRST_BLOCK) if plan.adaptive else plan.max_draft_tokens
    return min(k, max_new_tokens - 1)


async def _block_or_lead(stream: Stream, early: Worker):
    """(first block, the first Verdict's read still under way, None) once the block ``early``
    drafts is done; or (None, None, Verdict) when the cloud's first Verdict comes before it:
    the cloud led (Verdict.led) without a Draft of ours, and the block is no longer needed."""
    reading = asyncio.ensure_future(stream.recv("verdict"))
    # A loop that fails before it reads the Verdict leaves this read to the call's end
    reading.add_done_callback(lambda f: f.cancelled() or f.exception())
    try:
        await asyncio.wait({early.future, reading}, return_when=asyncio.FIRST_COMPLETED)
        if not reading.done():
            return await early.result(), reading, None
    except BaseException:
        reading.cancel()
        raise
    v = reading.result()
    if not v.led:
        raise SpecsplitError(None, "the cloud sent a Verdict before any Draft without Verdict.led")
    return None, None, v


async def _send_first(
    stream: Stream, early: Worker, starting: asyncio.Future, base_len: int
) -> Block | None:
    """A cloud-led stream's first block (drafted after the prompt by ``early``), sent as round
    1's Draft the moment it is done, while Started (``starting``) has not come: the block that
    was sent, else None (Started came first, or no token to send).

    Both sides start from the prompt, and the Draft follows Start on the same path, so it
    reaches the cloud while the target prefills or soon after, whatever the round trip: on a
    link too long for any later Draft (the cloud commits a round trip's worth of tokens before
    one arrives), it is the one that still lets a pass verify drafts. Its q, under the rejection
    rule, goes as floats: Started, which says whether the server takes counts, has not come."""
    await asyncio.wait({early.future, starting}, return_when=asyncio.FIRST_COMPLETED)
    if starting.done() or not early.future.done():
        return None
    block, _ = await early.result()
    if not block.tokens:
        return None
    draft = pb.Draft(round=1, base_len=base_len, tokens=block.tokens)
    # A sampled block (q) is verified by the rule asked, rejection where none was: the server
    # resolves it so for a drafting client (shared.acceptance.resolve_verification)
    if block.q is not None and stream.cfg.verification in (None, VerificationRule.REJECTION):
        draft.q.extend(sparse_to_pb(q, counts_ok=False) for q in block.q)
    try:
        await stream.send(pb.ClientMessage(draft=draft))
    except SpecsplitError:  # the stream ended meanwhile: reading Started tells how
        return None
    stream.stats.observe_drafts_sent(1)
    return block


def _rule(stream: Stream, proposer: Proposer, seed: int | None) -> DraftRule:
    cfg = stream.cfg
    return DraftRule.for_seed(cfg.sampling, seed, proposer.vocab_size, cfg.q_entries, cfg.q_levels)


def _check_pair(proposer: Proposer, model: pb.ModelInfo) -> None:
    """The draft and the target share a tokenizer (when both name theirs: a server that checks
    refused the Start already; an older one did not), and every id the draft may propose is one
    the target can verify. Vocabularies padded differently (Qwen2.5-0.5B's 151,936 rows, 7B's
    152,064) pair: neither side ever proposes or emits a padding row."""
    ours, theirs = proposer.tokenizer_fingerprint, model.tokenizer_fingerprint
    if ours and theirs and ours != theirs:
        raise SpecsplitError(
            None,
            f"the draft's tokenizer is not the target {model.name!r}'s "
            f"({ours[:19]}... != {theirs[:19]}...): not a matching draft model",
        )
    proposes = proposer.token_count or proposer.vocab_size
    if proposes > model.vocab_size:
        raise SpecsplitError(
            None,
            f"the draft may propose ids up to {proposes - 1}, beyond the target "
            f"{model.name!r}'s vocabulary ({model.vocab_size}): not a matching draft model",
        )
