"""Lock-step rounds: draft k, send, wait for the verdict, commit (DESIGN §2).

While a verdict is in flight the next block is drafted for "all accepted, bonus = the draft's
top token" and used when the verdict matches (DESIGN §4). k is chosen per round by
``edge.adaptive.DraftLength`` unless the config fixes it. In session mode ``auto`` the rounds
also measure whether cloud-led would be faster (``edge.mode_switch``); once it would, the next
Draft carries ``lead`` and the stream goes on as cloud-led rounds at once, that Draft the first
of their speculation (the cloud starts stepping without waiting as soon as it reads it).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from specsplit.edge.adaptive import DraftLength
from specsplit.edge.cloud_led import cloud_led_rounds
from specsplit.edge.mode_switch import LeadChoice
from specsplit.edge.session import Session
from specsplit.edge.worker import Worker
from specsplit.shared.protocol import pb, sparse_to_pb


async def lockstep_rounds(s: Session, started: pb.Started, first) -> AsyncIterator[list[int]]:
    cfg, stats = s.cfg, s.stats
    k_max = min(cfg.draft_tokens, started.limits.max_draft_tokens)
    chooser = DraftLength(k_max) if cfg.adapts else None
    may_lead = cfg.may_lead and started.accepts_lead
    switch = LeadChoice(k_max, cfg.sampling.greedy) if may_lead else None
    lead_now = may_lead and LeadChoice.lead_at_start(stats.start_rtt_ms, started.step_ms)
    t_prev = time.perf_counter()  # the last verdict (Started at first): a lock-step cycle
    mode = started.verification
    remaining = started.max_new_tokens
    round_no = 0
    hint = k_max  # the cloud's largest wanted block, updated by every verdict
    k = k_max
    while True:
        round_no += 1
        # A round emits up to k + 1 tokens: never draft past the length limit.
        k = max(0, min(k, hint, remaining - 1))
        base_len = len(s.committed)
        fresh = first is None
        if first is not None:  # drafted early (prefill, or the previous verdict in flight)
            (block, draft_ms), first = first, None
            block = block.head(k)
            k = len(block.tokens)  # shorter when the cloud's hint grew meanwhile
        else:
            block, draft_ms = await s.draft_off_loop(k)
        t1 = time.perf_counter()
        # Hand over with this block when cloud-led would be faster (and blocks remain after it).
        lead = switch is not None and remaining > k + 1 and (lead_now or switch.should_lead(k))
        draft = pb.Draft(round=round_no, base_len=base_len, tokens=block.tokens, lead=lead)
        if block.q is not None and mode == pb.VERIFICATION_MODE_REJECTION:
            draft.q.extend(sparse_to_pb(q, started.q_counts) for q in block.q)
        await s.send(pb.ClientMessage(draft=draft))
        if lead:
            stats.lead_round = round_no
            measured = switch.lengths  # acceptance per position so far
            async for chunk in cloud_led_rounds(s, started, remaining, round_no, block, measured):
                yield chunk
            return
        # The next block's size is chosen now, before the verdict, so it can be drafted ahead.
        planned = chooser.choose(hint) if chooser else k_max
        k_next = max(0, min(planned, hint, remaining - (k + 1) - 1))
        ahead = None
        if cfg.draft_ahead and k > 0 and k_next > 0:
            seq = [*s.committed, *block.tokens]
            ahead = Worker(s.draft_ahead, seq, k_next)
        try:
            v = await s.recv("verdict")
            t2 = time.perf_counter()
            if ahead is not None:
                guess, next_block = await ahead.result()
                waited_ms = (time.perf_counter() - t2) * 1e3
                if v.accepted == k and v.has_token and v.token == guess and not v.finished:
                    first = (next_block, waited_ms)  # only the wait is on the critical path
                    stats.ahead_hits += 1
        finally:
            if ahead is not None:  # the drafter must be idle before anyone else touches it
                await ahead.join()
        chunk = block.tokens[: v.accepted] + ([v.token] if v.has_token else [])
        s.committed += chunk
        remaining -= len(chunk)
        round_ms = (t2 - t1) * 1e3
        s.observe(v, k, draft_ms, round_ms)
        if cfg.obeys_hint and v.HasField("max_draft_tokens_hint"):
            hint = v.max_draft_tokens_hint
            stats.block_hint.append(hint)
        if chooser is not None:
            critical_ms = draft_ms if fresh else None  # a block drafted ahead hid its cost
            chooser.observe(k, v.accepted, v.timings.verify_ms, round_ms, critical_ms)
            stats.k_chosen.append(k)
        if switch is not None:
            cycle_ms = (t2 - t_prev) * 1e3
            switch.observe(k, v.accepted, cycle_ms, v.timings.verify_ms, v.timings.server_ms)
        t_prev = t2
        yield chunk
        if v.finished:
            return
        k = planned
