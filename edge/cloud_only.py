"""Cloud-only rounds on the edge (SessionMode.CLOUD_ONLY), the baseline: no Drafts; the target
generates alone and streams one Verdict per token, each committed as it arrives."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from specsplit.edge.stream import Stream, reason_name


async def cloud_only_rounds(stream: Stream) -> AsyncIterator[list[int]]:
    stats = stream.stats
    t_prev = time.perf_counter()
    while True:
        v = await stream.recv("verdict")
        now = time.perf_counter()
        stats.observe_verdict(v)  # no drafts: a round, its token committed
        stats.round_ms.append((now - t_prev) * 1e3)
        stats.verify_ms.append(v.timings.verify_ms)
        stats.batch_sessions.append(v.timings.batch_sessions)
        stats.batch_rows.append(v.timings.batch_rows)
        t_prev = now
        chunk = [v.token] if v.has_token else []
        stream.committed += chunk
        stream.check_committed(v)
        if v.finished:
            stream.final = reason_name(v.reason)
        yield chunk
        if v.finished:
            return
