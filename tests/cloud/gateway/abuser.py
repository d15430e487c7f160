"""The abusive client of tests/cloud/gateway/test_abusive_client.py, in its own process as it would
be on its own machine: run as ``python -m tests.cloud.gateway.abuser ADDRESS TOKEN STREAMS``.

It holds STREAMS max-context cloud-only streams, re-opening each as it ends and re-sending each
refused one 20 ms later, whatever its retry hint. It prints ``admitted N`` (a running count of
Started) as streams are admitted, stops when its standard input closes, and exits 1 on a status
other than the refusals it expects (RESOURCE_EXHAUSTED, UNAVAILABLE)."""

from __future__ import annotations

import asyncio
import os
import sys
import traceback

import grpc

from specsplit.shared.protocol import PROTOCOL_VERSION, SESSION_MODE_TO_PB, pb, pb_grpc
from specsplit.shared.session_mode import SessionMode

LONG_PROMPT = 900  # of the tiny target's 1024 positions: a 1024-position KV slot, 0.5 MiB
EXPECTED = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)


def long_start() -> pb.ClientMessage:
    return pb.ClientMessage(
        start=pb.Start(
            protocol_version=PROTOCOL_VERSION,
            prompt_ids=[1 + i % 200 for i in range(LONG_PROMPT)],
            sampling=pb.SamplingParams(max_new_tokens=60),
            session_mode=SESSION_MODE_TO_PB[SessionMode.CLOUD_ONLY],
        )
    )


async def abuse(address: str, token: str, stop: asyncio.Event, admitted: list[int]) -> None:
    """One abusive stream, re-opened as soon as it ends or is refused, until ``stop``."""
    meta = (("authorization", f"Bearer {token}"),)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.SpeculativeDecodingStub(channel)
        while not stop.is_set():
            call = stub.Generate(iter([long_start()]), metadata=meta, timeout=60)
            try:
                async for msg in call:
                    if msg.WhichOneof("msg") == "started":
                        admitted[0] += 1
                        print(f"admitted {admitted[0]}", flush=True)
                    if stop.is_set():
                        call.cancel()
                        break
            except grpc.aio.AioRpcError as e:
                # Refused (its quotas), or a stream the connection's cap refused (REFUSED_STREAM)
                if e.code() not in EXPECTED:
                    raise
                await asyncio.sleep(0.02)


async def main(address: str, token: str, streams: int) -> None:
    stop, admitted = asyncio.Event(), [0]
    loop = asyncio.get_running_loop()
    closed = loop.run_in_executor(None, sys.stdin.read)  # returns at EOF: the test is done
    closed.add_done_callback(lambda _: stop.set())
    tasks = [asyncio.create_task(abuse(address, token, stop, admitted)) for _ in range(streams)]
    try:
        await asyncio.gather(*tasks)
    except Exception:  # the first unexpected status fails the run, without waiting for stdin
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    address, token, streams = sys.argv[1], sys.argv[2], int(sys.argv[3])
    asyncio.run(main(address, token, streams))
