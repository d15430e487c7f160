"""The servicer's end of admission's StreamControl (cloud.gateway.service.StreamHandle): how a
stream is ended from outside its handler, against a fake call context."""

from __future__ import annotations

import asyncio

import grpc

from specsplit.cloud.gateway.admission import Admission
from specsplit.cloud.gateway.service import RECLAIMED, StreamHandle


class FakeContext:
    """A call context that records the status it is aborted with."""

    def __init__(self) -> None:
        self.aborted: list[tuple[grpc.StatusCode, str]] = []

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.aborted.append((code, details))
        raise grpc.aio.AbortError()  # what grpc.aio raises once a status is sent


async def _handle() -> tuple[StreamHandle, asyncio.Task, FakeContext, list]:
    ticket = Admission().enter(None)
    handler = asyncio.create_task(asyncio.sleep(60))  # the stream's handler, waiting
    context, background = FakeContext(), []
    handle = StreamHandle(ticket, handler, context, background.append)
    ticket.attach(handle)
    return handle, handler, context, background


def test_reclaiming_an_idle_stream_cancels_its_handler_which_sends_the_status():
    async def main():
        handle, handler, context, background = await _handle()
        handle.reclaim()
        await asyncio.gather(handler, return_exceptions=True)
        assert handler.cancelled()
        assert background == [] and context.aborted == []  # not mid-send: the handler sends it

    asyncio.run(main())


def test_a_stream_ended_mid_send_has_its_status_sent_from_outside_the_handler():
    async def main():
        handle, handler, context, background = await _handle()
        with handle.ticket.sending():  # a send the client does not read
            handle.end(grpc.StatusCode.DEADLINE_EXCEEDED, "the client read nothing for 5 s")
        await asyncio.gather(handler, return_exceptions=True)
        assert handler.cancelled() and len(background) == 1
        await background[0]  # the AbortError once sent is the caller's to swallow
        assert context.aborted == [
            (grpc.StatusCode.DEADLINE_EXCEEDED, "the client read nothing for 5 s")
        ]

    asyncio.run(main())


def test_a_stream_reclaimed_mid_send_is_told_to_retry_from_its_committed_sequence():
    async def main():
        handle, handler, context, background = await _handle()
        with handle.ticket.sending():
            handle.reclaim()
        await background[0]
        await asyncio.gather(handler, return_exceptions=True)
        assert context.aborted == [(grpc.StatusCode.UNAVAILABLE, RECLAIMED)]

    asyncio.run(main())
