"""Cloud-only sessions (Start.session_mode CLOUD_ONLY): the target generates alone, one Verdict
per step, while the stream is watched for a Finish.

A plain half-close is fine (the client only listens); only an explicit Finish cancels; a Draft
is refused. The watcher only raises a flag: a step in flight commits (and may set a stop
reason), and the Finish takes effect before the next step, so neither overwrites the other.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from specsplit.cloud.gateway.messages import next_draft
from specsplit.cloud.gateway.round import Round
from specsplit.cloud.gateway.session import Code, Finish, ProtocolError
from specsplit.shared.protocol import pb


async def cloud_only_rounds(step: Round, messages) -> AsyncIterator[pb.Verdict]:
    """Verdicts of a cloud-only session, one per target step, until generation ends."""
    session = step.session
    refused: list[ProtocolError] = []
    stop = asyncio.Event()

    async def watch() -> None:
        try:  # the client may stay silent for the whole generation: no idle timeout here
            msg = await next_draft(messages, None)
            if isinstance(msg, pb.Draft):
                raise ProtocolError(Code.FAILED_PRECONDITION, "a Draft in a cloud-only session")
        except ProtocolError as e:
            refused.append(e)
            msg = None
        if msg is not None or refused:
            stop.set()

    watcher = asyncio.create_task(watch())
    try:
        while session.finish is Finish.NONE:
            if stop.is_set():
                session.finish = Finish.CANCELLED
                break
            yield await step.verdict([], None, time.perf_counter())
        if refused:
            raise refused[0]
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await watcher
