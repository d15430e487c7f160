"""A cloud-led client that sends Drafts faster than the target steps: the pool keeps the
freshest few (cloud.gateway.cloud_led.POOL), and the gateway reads no more than a bounded number of
Drafts per target step; the rest wait in the client under gRPC flow control, instead of being
decoded and checked at line rate with no step to verify them."""

from __future__ import annotations

import asyncio

import grpc

from specsplit.cloud.gateway.cloud_led import reads_per_step
from specsplit.cloud.gateway.service import start_gateway
from specsplit.shared.protocol import PROTOCOL_VERSION, pb, pb_grpc
from tests.fakes import MODEL, NOWHERE, FakeTriton

SENT = 300


class HeldTarget(FakeTriton):
    """The target's steps wait until the test lets them go."""

    release: asyncio.Event

    async def step(self, *args, **kw):
        await self.release.wait()
        return await super().step(*args, **kw)


def _start() -> pb.ClientMessage:
    start = pb.Start(
        protocol_version=PROTOCOL_VERSION,
        prompt_ids=[1, 2, 3],
        sampling=pb.SamplingParams(max_new_tokens=4),
        session_mode=pb.SESSION_MODE_CLOUD_LED,
    )
    return pb.ClientMessage(start=start)


DRAFT = pb.ClientMessage(draft=pb.Draft(round=1, base_len=3, tokens=[4, 5, 6, 7]))


def test_drafts_read_per_target_step_are_bounded():
    async def run():
        HeldTarget.release = asyncio.Event()
        server, port, service = await start_gateway(NOWHERE, MODEL, sequence_factory=HeldTarget)
        received = lambda: service.metrics.registry.get_sample_value(  # noqa: E731
            "specsplit_received_bytes_total"
        )
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = pb_grpc.SpeculativeDecodingStub(channel).Generate(timeout=20)
                await call.write(_start())
                assert (await call.read()).WhichOneof("msg") == "started"
                before = received()
                for _ in range(SENT):  # all while the first step is held in the target
                    await call.write(DRAFT)
                await asyncio.sleep(0.5)
                read = (received() - before) / DRAFT.ByteSize()
                HeldTarget.release.set()
                await call.done_writing()
                messages = []
                while (msg := await call.read()) is not grpc.aio.EOF:
                    messages.append(msg)
                return read, messages
        finally:
            await server.stop(grace=None)
            await service.close()

    read, messages = asyncio.run(run())
    assert messages[-1].WhichOneof("msg") == "finished"
    assert read <= reads_per_step(MODEL.limits.max_draft_tokens) < SENT
