"""One stream's life, Start to Finished: the one place a session mode meets its loop.

Start asks for the plan's mode; the first lock-step block is drafted while the cloud prefills;
Started settles the plan (edge.session_plan) and brings the seed the draft rule needs; then the
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

import contextlib
import logging
from collections.abc import AsyncIterator, Sequence

import grpc

from specsplit.edge.cloud_led import cloud_led_rounds
from specsplit.edge.cloud_only import cloud_only_rounds
from specsplit.edge.drafting import DraftRule
from specsplit.edge.handover import Handover
from specsplit.edge.lockstep import lockstep_rounds
from specsplit.edge.proposer import Proposer, block_off_loop, timed_block
from specsplit.edge.sequence import Committed
from specsplit.edge.session_plan import SessionPlan
from specsplit.edge.stream import SpecsplitError, Stream
from specsplit.edge.worker import Worker
from specsplit.shared.protocol import pb
from specsplit.shared.session_mode import SessionMode

log = logging.getLogger(__name__)


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
    await stream.start(committed.tokens, plan.mode, fingerprint, plan.follows_lead)
    # Draft the first block (the draft's own prefill included) while the cloud prefills; a
    # sampled draft needs the seed first, which Started brings when the request sent none.
    if plan.mode is SessionMode.LOCK_STEP and (stream.seed is not None or cfg.sampling.greedy):
        rule = _rule(stream, proposer, stream.seed)
        k_first = min(plan.max_draft_tokens, stream.max_new_tokens - 1)
        early = Worker(timed_block, proposer, committed.tokens, k_first, rule)
    try:
        started = await stream.started()
        plan = plan.settled(started, stream.stats.start_rtt_ms)
        stream.stats.led_at_start = plan.auto and plan.mode is SessionMode.CLOUD_LED
        if plan.mode.drafts and rule is None:
            rule = _rule(stream, proposer, started.seed)
        first = await early.result() if early is not None else None
        if plan.mode is SessionMode.LOCK_STEP and first is None:
            k_first = min(plan.max_draft_tokens, started.max_new_tokens - 1)
            first = await block_off_loop(proposer, committed.tokens, k_first, rule)
    finally:
        if early is not None:  # the drafter must be idle before anyone else uses it
            await early.join()
    if plan.mode is not SessionMode.CLOUD_ONLY:
        _check_pair(proposer, started.model)
    mode, handover = plan.mode, None
    while True:
        if mode is SessionMode.CLOUD_ONLY:
            rounds = cloud_only_rounds(stream, committed)
        elif mode is SessionMode.CLOUD_LED:
            rounds = cloud_led_rounds(stream, committed, proposer, rule, plan, started, handover)
        else:
            rounds = lockstep_rounds(stream, committed, proposer, rule, plan, started, first)
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
