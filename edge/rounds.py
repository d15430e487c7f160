"""One stream's life, Start to Finished: the one place a session mode meets its loop.

Start asks for the plan's mode; the first lock-step block is drafted while the cloud prefills;
Started settles the plan (edge.session_plan) and brings the seed the draft rule needs; then the
loop of the mode the server runs takes the stream: ``lockstep_rounds`` (edge.lockstep),
``cloud_led_rounds`` (edge.cloud_led) or ``cloud_only_rounds`` (edge.cloud_only). A new mode
is a new loop module and a line here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from specsplit.edge.cloud_led import cloud_led_rounds
from specsplit.edge.cloud_only import cloud_only_rounds
from specsplit.edge.drafting import DraftRule
from specsplit.edge.lockstep import lockstep_rounds
from specsplit.edge.proposer import Proposer, block_off_loop, timed_block
from specsplit.edge.session_plan import SessionPlan
from specsplit.edge.stream import SpecsplitError, Stream
from specsplit.edge.worker import Worker
from specsplit.shared.protocol import pb
from specsplit.shared.session_mode import SessionMode


async def run_rounds(
    stream: Stream, proposer: Proposer | None, plan: SessionPlan
) -> AsyncIterator[list[int]]:
    """Yields each round's committed chunk; ``proposer`` None only when the plan is cloud-only."""
    cfg = stream.cfg
    rule = None
    early = None
    await stream.start(plan.mode)
    # Draft the first block (the draft's own prefill included) while the cloud prefills; a
    # sampled draft needs the seed first, which Started brings when the request sent none.
    if plan.mode is SessionMode.LOCK_STEP and (stream.seed is not None or cfg.sampling.greedy):
        rule = _rule(stream, proposer, stream.seed)
        k_first = min(plan.draft_tokens, stream.max_new_tokens - 1)
        early = Worker(timed_block, proposer, stream.committed, k_first, rule)
    try:
        started = await stream.started()
        plan = plan.settled(started, stream.stats.start_rtt_ms)
        stream.stats.led_at_start = plan.auto and plan.mode is SessionMode.CLOUD_LED
        if plan.mode.drafts and rule is None:
            rule = _rule(stream, proposer, started.seed)
        first = await early.result() if early is not None else None
        if plan.mode is SessionMode.LOCK_STEP and first is None:
            k_first = min(plan.draft_tokens, started.max_new_tokens - 1)
            first = await block_off_loop(proposer, stream.committed, k_first, rule)
    finally:
        if early is not None:  # the drafter must be idle before anyone else uses it
            await early.join()
    if plan.mode is SessionMode.CLOUD_ONLY:
        rounds = cloud_only_rounds(stream)
    else:
        _check_pair(proposer, started.model)
        if plan.mode is SessionMode.CLOUD_LED:
            rounds = cloud_led_rounds(stream, proposer, rule, plan, started)
        else:
            rounds = lockstep_rounds(stream, proposer, rule, plan, started, first)
    async for chunk in rounds:
        yield chunk
    await stream.finish()


def _rule(stream: Stream, proposer: Proposer, seed: int | None) -> DraftRule:
    cfg = stream.cfg
    return DraftRule.for_seed(cfg.sampling, seed, proposer.vocab_size, cfg.q_entries, cfg.q_levels)


def _check_pair(proposer: Proposer, model: pb.ModelInfo) -> None:
    if proposer.vocab_size > model.vocab_size:
        raise SpecsplitError(
            None,
            f"draft vocabulary ({proposer.vocab_size}) does not fit the target "
            f"{model.name!r} ({model.vocab_size}): not a matching draft model",
        )
