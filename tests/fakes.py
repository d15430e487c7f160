"""Fakes shared by tests: a Triton session that needs no Triton, a slow drafter, an in-process
gateway around them, a server for a hand-written Generate; and how a test waits for a stream
the server ends."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import AsyncIterator, Sequence

import grpc
import numpy as np

from specsplit.cloud.gateway.service import ModelIdentity, start_gateway
from specsplit.cloud.gateway.session import ModelLimits
from specsplit.cloud.gateway.triton_client import StepReply
from specsplit.shared.protocol import SERVICE_NAME, pb

VOCAB = 256
MODEL = ModelIdentity("tiny", "qwen2", ModelLimits(vocab_size=VOCAB, max_context=512))
NOWHERE = "127.0.0.1:1"  # no Triton: the fakes answer instead


async def stream_end(call) -> tuple[grpc.StatusCode, str]:
    """Reads a Generate stream until the server ends it: its status code and details."""
    try:
        while await call.read() is not grpc.aio.EOF:
            pass
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details()
    return await call.code(), ""


class FakeTriton:
    """Accepts no draft and answers token 7: the cloud side of a stream, without Triton."""

    def __init__(self, client) -> None:
        self.sequence_id = 1
        self.seeds: list[int] = []

    async def start(
        self, prompt, sampling, verification, seed: int, speculative: bool = True
    ) -> None:
        self.seeds.append(seed)

    async def reopen(self, prompt, sampling, verification, seed: int) -> None:
        self.seeds.append(seed)

    async def step(self, base_len: int, tokens: Sequence[int], q=None) -> StepReply:
        return StepReply(accepted=0, token=7, verify_ms=1.0, roundtrip_ms=1.0)

    async def close(self) -> None:
        pass


@contextlib.asynccontextmanager
async def gateway(factory=FakeTriton, **kw) -> AsyncIterator[str]:
    """An in-process gateway on a free port; yields its address, stops it on exit."""
    server, port, service = await start_gateway(NOWHERE, MODEL, sequence_factory=factory, **kw)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(grace=None)
        await service.close()


@contextlib.asynccontextmanager
async def generate_server(generate) -> AsyncIterator[str]:
    """A gRPC server on a free port whose one method, Generate, is ``generate`` (an async
    generator of ServerMessages: a scripted gateway, or a proxy that rewrites a real one's
    messages); yields its address, stops it on exit."""
    server = grpc.aio.server()
    handler = grpc.stream_stream_rpc_method_handler(
        generate,
        request_deserializer=pb.ClientMessage.FromString,
        response_serializer=pb.ServerMessage.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE_NAME, {"Generate": handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


class SlowDrafter:
    """A Drafter whose every forward pass takes ``delay_s``; records who uses it, and when."""

    def __init__(self, delay_s: float = 0.05, top: int = 9) -> None:
        self.vocab_size = VOCAB
        self.eos_token_ids: tuple[int, ...] = ()
        self.delay_s, self.top = delay_s, top
        self._cached: list[int] = []
        self.calls = 0
        self.active = 0  # forward passes in progress
        self.worker_seen = threading.Event()  # a forward pass ran outside the main thread
        self.loop_calls = 0  # forward passes on the main thread (where the event loop runs)

    @property
    def cached(self) -> list[int]:
        return list(self._cached)

    def truncate(self, n: int) -> None:
        del self._cached[n:]

    def forward(self, tokens: Sequence[int]) -> np.ndarray:
        self.active += 1
        self.calls += 1
        if threading.current_thread() is not threading.main_thread():
            self.worker_seen.set()
        else:
            self.loop_calls += 1
        try:
            time.sleep(self.delay_s)
            self._cached += list(tokens)
            logits = np.zeros((len(tokens), VOCAB), dtype=np.float32)
            logits[:, self.top] = 5.0
            return logits
        finally:
            self.active -= 1
