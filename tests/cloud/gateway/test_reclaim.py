"""Idle streams yield under pressure, on real parts (tritonserver + gateway at --max-sessions 4,
ONNX Runtime edges): silent streams, with a Start or without, never keep a fresh client out for
long, and an edge whose session was reclaimed re-opens and ends with the uninterrupted output."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from specsplit.cloud.supervision.process import CloudProcess
from specsplit.edge.client import GenerationConfig, SplitClient
from specsplit.edge.onnx_drafter import OnnxDrafter
from specsplit.shared.protocol import PROTOCOL_VERSION, pb, pb_grpc
from specsplit.shared.tiny import reference_greedy
from tests.cloud.gateway.test_gateway_cancel import held_kv_caches, wait_for_kv_caches
from tests.fakes import stream_end

pytestmark = pytest.mark.slow
MAX_SESSIONS = 4
GRACE_S = 0.5
SERVED_WITHIN_S = 2.0
PROMPT = [1, 2, 3, 4, 5]
N_NEW = 12


@pytest.fixture(scope="module")
def full(cloud, tiny, tmp_path_factory):
    """A gateway with few places and a short reclaim grace, in front of the shared Triton;
    hard deadlines far off, so only the reclaim policy can end a silent stream in time."""
    args = ["--triton-url", cloud.triton_url, "--target", str(tiny.target)]
    args += ["--max-sessions", str(MAX_SESSIONS), "--reclaim-idle-after", str(GRACE_S)]
    args += ["--start-deadline", "60", "--idle-timeout", "60"]
    with CloudProcess(*args, log_dir=tmp_path_factory.mktemp("reclaim")) as c:
        yield c


class Holders:
    """Streams that send a Start (or nothing) and then stay silent; each one's end is recorded;
    all are cancelled on exit."""

    def __init__(self, stub):
        self.stub = stub
        self.calls: list[grpc.aio.StreamStreamCall] = []
        self.ends: list[asyncio.Task] = []

    async def open(self, n: int, send_start: bool) -> None:
        for _ in range(n):
            call = self.stub.Generate(timeout=120)
            self.calls.append(call)
            if send_start:
                start = pb.Start(
                    protocol_version=PROTOCOL_VERSION,
                    prompt_ids=[9, 9, 9],
                    sampling=pb.SamplingParams(max_new_tokens=200),
                )
                await call.write(pb.ClientMessage(start=start))
                assert (await call.read()).WhichOneof("msg") == "started"
            else:
                await call.wait_for_connection()
            self.ends.append(asyncio.create_task(stream_end(call)))

    def reclaimed(self) -> list[grpc.StatusCode]:
        return [t.result()[0] for t in self.ends if t.done() and not t.cancelled()]

    async def __aenter__(self) -> Holders:
        return self

    async def __aexit__(self, *exc) -> None:
        for call in self.calls:
            call.cancel()
        await asyncio.gather(*self.ends, return_exceptions=True)


async def _served(address: str, drafter, n_new: int = N_NEW) -> tuple[float, object]:
    cfg = GenerationConfig(max_new_tokens=n_new, retry_window_s=30.0)
    async with SplitClient(address, drafter) as client:
        t0 = time.monotonic()
        gen = client.generate(PROMPT, cfg)
        await asyncio.wait_for(gen.collect(), 30)
        return time.monotonic() - t0, gen


@pytest.mark.parametrize("send_start", [True, False], ids=["started", "sent-nothing"])
def test_silent_streams_yield_to_a_fresh_client(full, cloud, tiny, send_start):
    baseline = held_kv_caches(cloud.triton_url)
    drafter = OnnxDrafter(tiny.draft_onnx)

    async def run():
        async with (
            grpc.aio.insecure_channel(full.address) as channel,
            Holders(pb_grpc.SpeculativeDecodingStub(channel)) as holders,
        ):
            await holders.open(MAX_SESSIONS, send_start)  # every place taken
            await asyncio.sleep(GRACE_S + 0.3)  # all idle beyond the grace
            waited, gen = await _served(full.address, drafter)
            await asyncio.sleep(0.2)
            return waited, gen, holders.reclaimed()

    waited, gen, reclaimed = asyncio.run(run())
    print(f"served after {waited:.2f} s ({'Start' if send_start else 'nothing'} sent)")
    assert waited < SERVED_WITHIN_S
    assert gen.token_ids == reference_greedy(tiny.target, PROMPT, N_NEW)
    assert gen.stats.retries == 0  # admitted at once: no client-visible refusal
    assert reclaimed and set(reclaimed) == {grpc.StatusCode.UNAVAILABLE}
    assert wait_for_kv_caches(cloud.triton_url, baseline) == baseline


class PausingDrafter:
    """An ONNX drafter that stops, once, at its ``pause_at``-th forward pass until resumed: an
    edge gone quiet mid-generation (backgrounded, a link down) with its session open."""

    def __init__(self, inner: OnnxDrafter, pause_at: int):
        self.inner, self.pause_at, self.calls = inner, pause_at, 0
        self.vocab_size, self.eos_token_ids = inner.vocab_size, inner.eos_token_ids
        self.paused, self.resume = threading.Event(), threading.Event()

    @property
    def cached(self) -> list[int]:
        return self.inner.cached

    def truncate(self, n: int) -> None:
        self.inner.truncate(n)

    def forward(self, tokens):
        self.calls += 1
        if self.calls == self.pause_at:
            self.paused.set()
            self.resume.wait(60)
        return self.inner.forward(tokens)


def test_a_reclaimed_edge_comes_back_and_ends_with_the_uninterrupted_output(full, cloud, tiny):
    baseline = held_kv_caches(cloud.triton_url)
    n_quiet = 24
    quiet = PausingDrafter(OnnxDrafter(tiny.draft_onnx), pause_at=4)
    result: dict = {}

    def quiet_edge() -> None:  # its own thread and loop: its pause blocks nothing else
        cfg = GenerationConfig(
            max_new_tokens=n_quiet, retry_window_s=30.0, session_mode="lock-step"
        )

        async def go():
            async with SplitClient(full.address, quiet) as client:
                gen = client.generate(PROMPT, cfg)
                await asyncio.wait_for(gen.collect(), 60)
                return gen

        try:
            result["gen"] = asyncio.run(go())
        except BaseException as e:
            result["error"] = e

    edge = threading.Thread(target=quiet_edge, daemon=True)
    edge.start()

    async def run():
        async with (
            grpc.aio.insecure_channel(full.address) as channel,
            Holders(pb_grpc.SpeculativeDecodingStub(channel)) as holders,
        ):
            try:
                assert await asyncio.to_thread(quiet.paused.wait, 30), "edge never paused"
                # Every place taken; the quiet edge is the least recently active.
                await holders.open(MAX_SESSIONS - 1, send_start=True)
                await asyncio.sleep(GRACE_S + 0.3)
                served = await _served(full.address, OnnxDrafter(tiny.draft_onnx))
                return served, holders.reclaimed()
            finally:
                quiet.resume.set()
                await asyncio.to_thread(edge.join, 60)

    (waited, fresh), holders_reclaimed = asyncio.run(run())
    print(f"served after {waited:.2f} s; the quiet edge re-opened {result['gen'].stats.retries}x")
    assert "error" not in result, result.get("error")
    assert waited < SERVED_WITHIN_S
    assert fresh.token_ids == reference_greedy(tiny.target, PROMPT, N_NEW)
    assert holders_reclaimed == []  # the least recently active session went: the quiet edge's
    gen = result["gen"]
    assert gen.stats.retries >= 1
    assert gen.token_ids == reference_greedy(tiny.target, PROMPT, n_quiet)
    assert wait_for_kv_caches(cloud.triton_url, baseline) == baseline
