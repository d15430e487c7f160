"""edge.stream: the transport of one generation's stream."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from specsplit.edge.client import GenerationConfig
from specsplit.edge.generation import GenerationStats
from specsplit.edge.retry import retry_after_s
from specsplit.edge.stream import Stream
from specsplit.shared.protocol import RETRY_AFTER_KEY, pb


class EndedCall:
    """A call the server already ended with ``code`` and a retry hint: writes fail."""

    def __init__(self, code: grpc.StatusCode):
        self._code = code

    async def write(self, msg) -> None:
        raise asyncio.InvalidStateError("the call is done")

    async def code(self) -> grpc.StatusCode:
        return self._code

    async def details(self) -> str:
        return "KV memory budget full"

    async def trailing_metadata(self) -> grpc.aio.Metadata:
        return grpc.aio.Metadata((RETRY_AFTER_KEY, "250"))


def test_a_write_after_the_server_ended_the_call_keeps_its_retry_hint():
    """A cloud-led edge writes Drafts while the cloud streams: the status that ended the call
    (RESOURCE_EXHAUSTED for a session whose KV could not grow) reaches it through a failed
    write, and its hint must come with it, or the edge takes a busy cloud for its own quota
    and gives up."""
    stream = Stream(None, None, GenerationConfig(), GenerationStats(route="split"), 8, None)
    stream.call = EndedCall(grpc.StatusCode.RESOURCE_EXHAUSTED)
    draft = pb.ClientMessage(draft=pb.Draft(round=1, base_len=1, tokens=[2]))

    with pytest.raises(grpc.aio.AioRpcError) as e:
        asyncio.run(stream.send(draft))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert retry_after_s(e.value) == 0.25
