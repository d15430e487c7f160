"""edge.stream: the transport of one generation's stream (and its Echo of a Probe)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from specsplit.edge.client import GenerationConfig
from specsplit.edge.generation import GenerationStats
from specsplit.edge.retry import retry_after_s
from specsplit.edge.stream import SpecsplitError, Stream
from specsplit.shared.protocol import RETRY_AFTER_KEY, pb, pb_grpc
from specsplit.shared.session_mode import SessionMode
from tests.fakes import generate_server


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


def _probing_server(seen: list[str]):
    """A scripted Generate: Start; a Probe where Start asks for one, and then Started only
    once the Echo came (none within 10 s: the stream ends without Started); records every
    message kind it read."""

    async def generate(requests, context):
        start = await anext(requests)
        seen.append(start.WhichOneof("msg"))
        if start.start.probe:
            yield pb.ServerMessage(probe=pb.Probe())
            echo = await asyncio.wait_for(anext(requests), 10)
            seen.append(echo.WhichOneof("msg"))
            if seen[-1] != "echo":
                return
        yield pb.ServerMessage(started=pb.Started(session_mode=pb.SESSION_MODE_LOCK_STEP))

    return generate


@pytest.mark.parametrize("follows_lead", [True, False])
def test_a_client_that_follows_the_lead_echoes_the_probe_before_started(follows_lead):
    """The edge asks for a Probe exactly when it follows the cloud's lead (Start.probe), and
    answers it at once, while it waits for Started: the cloud times the round trip with it."""
    seen: list[str] = []

    async def main():
        async with (
            generate_server(_probing_server(seen)) as address,
            grpc.aio.insecure_channel(address) as channel,
        ):
            stats = GenerationStats(route="split")
            stream = Stream(
                pb_grpc.SpeculativeDecodingStub(channel), None, GenerationConfig(), stats, 8, 1
            )
            await stream.start([1, 2, 3], SessionMode.LOCK_STEP, follows_lead=follows_lead)
            started = await asyncio.wait_for(stream.started(), 30)
            await stream.close()
            return started

    started = asyncio.run(main())
    assert started.session_mode == pb.SESSION_MODE_LOCK_STEP
    assert seen == (["start", "echo"] if follows_lead else ["start"])


def test_a_probe_no_one_asked_for_is_an_error():
    async def generate(requests, context):
        await anext(requests)
        yield pb.ServerMessage(probe=pb.Probe())

    async def main():
        async with (
            generate_server(generate) as address,
            grpc.aio.insecure_channel(address) as channel,
        ):
            stats = GenerationStats(route="split")
            stream = Stream(
                pb_grpc.SpeculativeDecodingStub(channel), None, GenerationConfig(), stats, 8, 1
            )
            await stream.start([1, 2, 3], SessionMode.LOCK_STEP, follows_lead=False)
            try:
                with pytest.raises(SpecsplitError, match="expected started, got probe"):
                    await asyncio.wait_for(stream.started(), 30)
            finally:
                await stream.close()

    asyncio.run(main())
