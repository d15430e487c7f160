"""The edge's retry window (edge/retry.py) and when it applies."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from specsplit.edge.client import GenerationConfig, SpecsplitError, SplitClient
from specsplit.edge.retry import Backoff, refused_at_handshake, retry_after_s
from specsplit.shared.protocol import PROTOCOL_VERSION, pb
from tests.fakes import MODEL, SlowDrafter, generate_server


def test_backoff_doubles_up_to_its_cap_and_ends_with_the_window(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("specsplit.edge.retry.time.monotonic", lambda: now[0])
    backoff = Backoff(window_s=10.0, first_s=1.0, max_s=4.0)
    pauses = []
    while (pause := backoff.next_pause()) is not None:
        pauses.append(pause)
        now[0] += pause
    assert pauses == [1.0, 2.0, 4.0]  # a fourth (4 s) would end at 11 s, past the window
    backoff.progress()  # tokens arrived: the next outage gets a whole window
    assert backoff.next_pause() == 1.0


@pytest.mark.parametrize(
    "details, fatal",
    [
        (
            "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:1.2.3.4:8: "
            "Socket closed",
            True,
        ),
        (
            "failed to connect to all addresses; last error: UNKNOWN: ipv4:1.2.3.4:8: "
            "Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: CERTIFICATE_VERIFY_FAILED",
            True,
        ),
        (
            "failed to connect to all addresses; last error: UNKNOWN: ipv4:1.2.3.4:8: Failed to "
            "connect to remote host: Connection refused",
            False,
        ),
        ("Socket closed", False),  # a call that broke after connecting: an outage
        ("inference server unavailable", False),
    ],
)
def test_a_refused_handshake_is_told_from_an_outage(details, fatal):
    e = grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details
    )
    assert refused_at_handshake(e) is fatal


def test_a_busy_clouds_hint_is_a_floor_under_the_backoff(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("specsplit.edge.retry.time.monotonic", lambda: now[0])
    backoff = Backoff(window_s=10.0, first_s=1.0, max_s=4.0)
    assert backoff.next_pause(at_least=3.0) == 3.0  # the cloud asked for 3 s
    now[0] += 3.0
    assert backoff.next_pause(at_least=0.1) == 2.0  # a repeated refusal still backs off
    now[0] += 2.0
    assert backoff.next_pause(at_least=6.0) is None  # 6 s more would end past the window


@pytest.mark.parametrize(
    "metadata, seconds",
    [((("retry-after-ms", "1500"),), 1.5), ((), None), ((("retry-after-ms", "soon"),), None)],
)
def test_the_retry_hint_is_read_from_the_trailing_metadata(metadata, seconds):
    e = grpc.aio.AioRpcError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(*metadata),
        "busy",
    )
    assert retry_after_s(e) == seconds


def test_negative_window_is_refused():
    with pytest.raises(ValueError, match="window"):
        Backoff(window_s=-1)


class FinalThenBreak:
    """A gateway that sends Started and a final Verdict, then fails the stream UNAVAILABLE
    (a link that dies just before Finished)."""

    def __init__(self) -> None:
        self.calls = 0

    async def generate(self, request_iterator, context):
        self.calls += 1
        first = await request_iterator.__anext__()
        n = len(first.start.prompt_ids)
        cloud_only = first.start.session_mode == pb.SESSION_MODE_CLOUD_ONLY
        mode = pb.SESSION_MODE_CLOUD_ONLY if cloud_only else pb.SESSION_MODE_LOCK_STEP
        yield pb.ServerMessage(
            started=pb.Started(
                session_id="s",
                model=MODEL.to_pb(),
                limits=pb.Limits(max_draft_tokens=4, max_context=512, max_q_entries=8),
                protocol_version=PROTOCOL_VERSION,
                committed_len=n,
                max_new_tokens=1,
                seed=5,
                session_mode=mode,  # a lock-step server: cloud-led asks run lock-step
            )
        )
        if mode == pb.SESSION_MODE_LOCK_STEP:
            await request_iterator.__anext__()  # the Draft the verdict answers
        yield pb.ServerMessage(
            verdict=pb.Verdict(
                token=9, has_token=True, committed_len=n + 1, finished=True, reason=3
            )
        )
        await context.abort(grpc.StatusCode.UNAVAILABLE, "link lost")


async def _run_against(servicer, mode: str) -> tuple[list[int], object]:
    async with (
        generate_server(servicer.generate) as address,
        SplitClient(address, SlowDrafter(0.0)) as client,
    ):
        gen = client.generate([1, 2, 3], GenerationConfig(max_new_tokens=1), route=mode)
        return await gen.collect(), gen.stats


@pytest.mark.parametrize("mode", ["split", "cloud-only"])
def test_never_reopens_after_the_final_verdict(mode):
    servicer = FinalThenBreak()
    tokens, stats = asyncio.run(_run_against(servicer, mode))
    assert tokens == [9]
    assert servicer.calls == 1, "re-opened a finished generation"
    assert stats.finish == "LENGTH" and stats.retries == 0


class AlwaysUnavailable:
    def __init__(self) -> None:
        self.calls = 0

    async def generate(self, request_iterator, context):
        self.calls += 1
        await context.abort(grpc.StatusCode.UNAVAILABLE, "down")
        yield  # pragma: no cover


def test_unavailable_is_retried_until_the_window_ends():
    servicer = AlwaysUnavailable()

    async def run():
        async with (
            generate_server(servicer.generate) as address,
            SplitClient(address, SlowDrafter(0.0)) as client,
        ):
            cfg = GenerationConfig(max_new_tokens=4, retry_window_s=1.0)
            gen = client.generate([1, 2, 3], cfg, route="cloud-only")
            with pytest.raises(SpecsplitError) as err:
                await gen.collect()
            return err.value, gen.stats

    error, stats = asyncio.run(run())
    assert error.code == grpc.StatusCode.UNAVAILABLE
    assert servicer.calls == stats.retries + 1 >= 3  # 0.25 + 0.5 s fit in 1 s; 1 s more does not


class _BrokenCall:
    """A call whose write failed in grpc core: grpc.aio then fails its reads as INTERNAL too."""

    async def write(self, msg):
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(), "from Core"
        )

    async def read(self):
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(), "from Core"
        )


def test_reads_after_a_failed_write_count_as_a_broken_stream():
    from specsplit.edge.generation import GenerationStats
    from specsplit.edge.stream import Stream

    session = Stream(None, None, GenerationConfig(), GenerationStats("split"), 4, 0)
    session.call = _BrokenCall()

    async def go():
        with pytest.raises(grpc.aio.AioRpcError) as read_first:  # the server's own INTERNAL
            await session.recv("verdict")
        with pytest.raises(grpc.aio.AioRpcError) as write:
            await session.send(pb.ClientMessage(draft=pb.Draft(round=1, base_len=1, tokens=[2])))
        with pytest.raises(grpc.aio.AioRpcError) as read_after:
            await session.recv("verdict")
        return read_first.value, write.value, read_after.value

    read_first, write, read_after = asyncio.run(go())
    assert read_first.code() == grpc.StatusCode.INTERNAL
    # retryable: the generation re-opens from what it committed
    assert write.code() == grpc.StatusCode.UNAVAILABLE
    assert read_after.code() == grpc.StatusCode.UNAVAILABLE
