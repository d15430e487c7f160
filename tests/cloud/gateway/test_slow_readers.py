"""Clients that stop reading: a stream whose Verdicts pile up unread (gRPC flow control holds
the gateway's send) must not keep its place and KV memory: it is ended after the idle timeout,
and under pressure it yields like any idle session.

The client here never reads and turns off BDP probing, so its stream's flow-control window
stays at 64 KiB: the gateway's sends block after some two thousand Verdicts, as they would for
a client that stopped reading its socket."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc

from specsplit.cloud.gateway.admission import Admission
from specsplit.cloud.gateway.service import ModelIdentity, start_gateway
from specsplit.cloud.gateway.session import ModelLimits
from specsplit.cloud.gateway.stream_policy import StreamPolicy
from specsplit.shared.protocol import PROTOCOL_VERSION, pb, pb_grpc
from tests.fakes import NOWHERE, VOCAB, FakeTriton

# A context long enough for a cloud-only stream to outrun any flow-control window.
LONG = ModelIdentity("long", "qwen2", ModelLimits(vocab_size=VOCAB, max_context=1 << 24))
NO_BDP = [("grpc.http2.bdp_probe", 0)]


@contextlib.asynccontextmanager
async def long_gateway(admission: Admission, policy: StreamPolicy):
    server, port, service = await start_gateway(
        NOWHERE, LONG, policy=policy, sequence_factory=FakeTriton, admission=admission
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=NO_BDP) as channel:
            yield pb_grpc.SpeculativeDecodingStub(channel), service
    finally:
        await server.stop(grace=None)
        await service.close()


def _cloud_only(max_new_tokens: int) -> pb.ClientMessage:
    start = pb.Start(
        protocol_version=PROTOCOL_VERSION,
        prompt_ids=[1, 2, 3],
        sampling=pb.SamplingParams(max_new_tokens=max_new_tokens),
        session_mode=pb.SESSION_MODE_CLOUD_ONLY,
    )
    return pb.ClientMessage(start=start)


async def _never_reading(stub) -> grpc.aio.StreamStreamCall:
    call = stub.Generate(timeout=60)
    await call.write(_cloud_only(10_000_000))
    await call.done_writing()
    return call


async def _until(condition, within_s: float) -> float:
    t0 = time.monotonic()
    while not condition():
        if time.monotonic() - t0 > within_s:
            raise AssertionError(f"not within {within_s} s")
        await asyncio.sleep(0.05)
    return time.monotonic() - t0


async def _status(call: grpc.aio.StreamStreamCall) -> grpc.StatusCode:
    """Reads what piled up, then the status the stream ended with."""
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as e:
        return e.code()
    return await call.code()


def test_a_client_that_never_reads_its_verdicts_is_ended_after_the_idle_timeout():
    admission = Admission(max_sessions=4)

    async def run():
        async with long_gateway(admission, StreamPolicy(idle_timeout_s=1.0)) as (stub, service):
            call = await _never_reading(stub)
            try:
                await _until(lambda: admission.live, within_s=5.0)  # admitted, generating
                waited = await _until(lambda: admission.open == 0, within_s=5.0)
                code = await asyncio.wait_for(_status(call), 10)
            finally:
                call.cancel()
            errors = service.metrics.registry.get_sample_value(
                "specsplit_errors_total", {"code": "DEADLINE_EXCEEDED"}
            )
            return waited, code, errors

    waited, code, errors = asyncio.run(run())
    assert waited < 3.0 and not admission.live
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and errors == 1


def test_a_client_that_never_reads_yields_its_place_under_pressure():
    admission = Admission(max_sessions=1, reclaim_after_s=0.3)

    async def run():
        async with long_gateway(admission, StreamPolicy(idle_timeout_s=60.0)) as (stub, _):
            stuck = await _never_reading(stub)
            try:
                # Its sends block once the window fills, and it is idle beyond the grace from
                # then: waited for, not slept on (a loaded machine fills the window later than
                # an idle one; after a fixed second the stream was still sending under CI).
                await _until(lambda: admission.reclaimable(), within_s=10.0)
                t0 = time.monotonic()
                fresh = [m async for m in stub.Generate(iter([_cloud_only(8)]), timeout=10)]
                waited = time.monotonic() - t0
                return waited, fresh, await asyncio.wait_for(_status(stuck), 10)
            finally:
                stuck.cancel()

    waited, fresh, code = asyncio.run(run())
    assert fresh[0].WhichOneof("msg") == "started" and fresh[-1].WhichOneof("msg") == "finished"
    assert waited < 1.5
    assert code == grpc.StatusCode.UNAVAILABLE  # reclaimed: retry from the committed sequence
