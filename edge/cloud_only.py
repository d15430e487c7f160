"""Cloud-only rounds on the edge (SessionMode.CLOUD_ONLY), the baseline: no Drafts; the target
generates alone and streams one Verdict per token, each committed (edge.sequence) as it arrives."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from specsplit.edge.sequence import Committed
from specsplit.edge.stream import Stream


async def cloud_only_rounds(stream: Stream, committed: Committed) -> AsyncIterator[list[int]]:
    stats = stream.stats
    t_prev = time.perf_counter()
    while True:
        v = await stream.recv("verdict")
        now = time.perf_counter()
        chunk = [v.token] if v.has_token else []
        committed.commit(chunk, v)
        stats.observe_round(v, (now - t_prev) * 1e3)  # no drafts: a round, its token committed
        t_prev = now
        yield chunk
        if v.finished:
            return
