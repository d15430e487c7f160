"""What one client may cost the gateway besides sessions (issue 39, item 4): a stream without a
valid token is refused from its metadata, none of its messages read; a stream whose client
re-sends before its retry hint is held, unread, until the hint runs out
(``cloud.gateway.retry_gate``); one connection holds at most
``StreamPolicy.max_streams_per_connection`` streams. (The per-client KV quota's accounting is in
test_admission.py.)"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from specsplit.cloud.gateway.admission import Admission, KVShape
from specsplit.cloud.gateway.messages import REFUSE_UNREAD_AFTER_S
from specsplit.cloud.gateway.replicas import ReplicaSet
from specsplit.cloud.gateway.retry_gate import PACE_S, RetryGate
from specsplit.cloud.gateway.security import Security, TokenAuth
from specsplit.cloud.gateway.service import SpeculativeService, start_gateway
from specsplit.cloud.gateway.stream_policy import StreamPolicy
from specsplit.cloud.gateway.triton_client import TritonSequence
from specsplit.shared.acceptance import VerificationRule
from specsplit.shared.protocol import (
    PROTOCOL_VERSION,
    RETRY_AFTER_KEY,
    SESSION_MODE_TO_PB,
    pb,
    pb_grpc,
)
from specsplit.shared.sampling import SamplingConfig
from specsplit.shared.session_mode import SessionMode
from tests.fakes import MODEL, NOWHERE, FakeTriton, gateway, stream_end

KV = KVShape(layers=2, kv_heads=2, head_dim=16, dtype_bytes=4)  # the tiny test model: 512 B

CLOUD_ONLY = pb.ClientMessage(
    start=pb.Start(
        protocol_version=PROTOCOL_VERSION,
        prompt_ids=[1, 2, 3],
        sampling=pb.SamplingParams(max_new_tokens=400),
        session_mode=SESSION_MODE_TO_PB[SessionMode.CLOUD_ONLY],
    )
)


# Channels to one address share a connection unless told otherwise.
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


class _Details:
    method = "/specsplit.v1.SpeculativeDecoding/Generate"
    invocation_metadata = (("authorization", "Bearer wrong"),)


class _Aborted(Exception):
    pass


class _Context:
    def __init__(self):
        self.status, self.trailing = None, ()

    async def abort(self, code, details, trailing_metadata=()):
        self.status, self.trailing = code, trailing_metadata
        raise _Aborted()


class _Watched:
    """A request stream that counts the messages taken from it."""

    def __init__(self):
        self.read = 0

    def __aiter__(self):
        return self

    async def __anext__(self):
        self.read += 1
        return pb.ClientMessage()


def test_an_unauthenticated_stream_is_refused_without_reading_a_message():
    """It used to read the first message (up to --max-message-bytes) before refusing."""

    async def generate(requests, context):
        raise AssertionError("the handler must not run")
        yield

    async def run():
        async def continuation(details):
            return grpc.stream_stream_rpc_method_handler(generate)

        handler = await TokenAuth([b"right"]).intercept_service(continuation, _Details())
        requests, context = _Watched(), _Context()
        with pytest.raises(_Aborted):
            await handler.stream_stream(requests, context)
        return requests.read, context.status

    read, status = asyncio.run(run())
    assert status == grpc.StatusCode.UNAUTHENTICATED
    assert read == 0


def test_one_connection_holds_at_most_its_cap_of_streams():
    """A client opening many streams on one connection gets no more than the cap open at the
    gateway; the next waits in its own transport until one ends, while another connection is
    served meanwhile."""

    async def run():
        async with (
            gateway(policy=StreamPolicy(max_streams_per_connection=2)) as address,
            grpc.aio.insecure_channel(address, options=OWN_CONNECTION) as greedy,
            grpc.aio.insecure_channel(address, options=OWN_CONNECTION) as other,
        ):
            stub = pb_grpc.SpeculativeDecodingStub(greedy)
            calls = [stub.Generate(iter([CLOUD_ONLY]), timeout=30) for _ in range(3)]
            reads = {asyncio.ensure_future(c.read()): c for c in calls}
            done: set = set()
            while len(done) < 2:
                finished, _ = await asyncio.wait(
                    set(reads) - done, return_when=asyncio.FIRST_COMPLETED
                )
                done |= finished
            # Another connection's stream, opened after the three, is served before the third.
            call = pb_grpc.SpeculativeDecodingStub(other).Generate(iter([CLOUD_ONLY]), timeout=30)
            assert (await call.read()).WhichOneof("msg") == "started"
            call.cancel()
            [waiting] = set(reads) - done
            served_first = [t.result().WhichOneof("msg") for t in done if t.done()]
            third_waited = not waiting.done()
            reads[next(iter(done))].cancel()  # one of the two ends: the third may open
            third = await waiting
            for c in calls:
                c.cancel()
            return served_first, third_waited, third.WhichOneof("msg")

    assert asyncio.run(run()) == (["started", "started"], True, "started")


def test_the_cap_reaches_the_server_options():
    options = dict(StreamPolicy(max_streams_per_connection=3).server_options())
    assert options["grpc.max_concurrent_streams"] == 3
    with pytest.raises(ValueError, match="streams per connection"):
        StreamPolicy(max_streams_per_connection=0)


def test_each_sequence_tells_the_target_its_client():
    """The target shares prefill rows per pass among clients (cloud.engine.target): the gateway
    tags each sequence with its client's quota key, hashed; two tokens, two shares."""
    shares: list[int] = []

    class Recording(FakeTriton):
        async def start(self, prompt, sampling, verification, seed: int, speculative: bool = True):
            shares.append(self.client_share)

    async def one(address: str, token: str) -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            call = pb_grpc.SpeculativeDecodingStub(channel).Generate(
                iter([CLOUD_ONLY]), metadata=(("authorization", f"Bearer {token}"),), timeout=30
            )
            assert (await call.read()).WhichOneof("msg") == "started"
            call.cancel()

    async def run():
        security = Security(tokens=(b"alpha", b"beta"))
        async with gateway(Recording, security=security) as address:
            for token in ("alpha", "beta", "alpha"):
                await one(address, token)

    asyncio.run(run())
    assert shares[0] == shares[2] != shares[1] and all(s > 0 for s in shares)


def test_a_start_sends_its_client_share():
    sent = []

    class Client:
        def stream_infer(self, requests):
            async def replies():
                async for request in requests:
                    sent.append({i.name(): i for i in request["inputs"]})
                    yield _StartResult(), None

            return replies()

    async def run():
        sequence = TritonSequence(Client())
        sequence.client_share = 12345
        await sequence.start([1, 2], SamplingConfig(), VerificationRule.GREEDY, seed=0)
        await sequence.close()

    asyncio.run(run())
    assert "CLIENT" in sent[0]


class _StartResult:
    def as_numpy(self, name):
        return None


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_gate_remembers_each_clients_retry_hint():
    clock = _Clock()
    gate = RetryGate(clock=clock)
    gate.told("a", 200)
    gate.told(None, 200)  # no quota applies (a loopback peer): never held
    gate.told("b", None)  # a refusal without a hint: no gate
    assert gate.wait_s("a") == pytest.approx(0.2)
    assert gate.wait_s("b") is None and gate.wait_s(None) is None
    clock.now += 0.15
    gate.told("a", 10)  # a shorter hint does not shorten the longer one
    assert gate.wait_s("a") == pytest.approx(0.05)
    clock.now += 0.05
    assert gate.wait_s("a") is None and not gate.not_before


def test_a_held_stream_goes_on_once_the_hint_ran_out_and_paces_the_next():
    async def run():
        gate = RetryGate()
        assert await gate.hold("a") is None and gate.holds == 0  # never told: not held
        gate.told("a", 30)
        held = asyncio.ensure_future(gate.hold("a"))
        await asyncio.sleep(0)
        now = dict(gate.held)
        assert await held is None
        return gate, now

    gate, held_meanwhile = asyncio.run(run())
    assert held_meanwhile == {"a": 1} and gate.holds == 1 and not gate.held
    assert 0 < gate.wait_s("a") <= PACE_S  # the next held stream follows after this one


def test_past_its_held_streams_a_client_is_refused_at_once():
    async def run():
        gate = RetryGate(max_held=1)
        gate.told("a", 5_000)
        first = asyncio.ensure_future(gate.hold("a"))
        await asyncio.sleep(0)
        second = await gate.hold("a")
        other = await gate.hold("b")
        first.cancel()
        return second, other, gate

    refused, other, gate = asyncio.run(run())
    assert other is None and not gate.held  # a cancelled held stream leaves the count
    assert refused.reason == "retry_early" and 0 < refused.retry_after_ms <= 5_000
    assert "re-sent before its retry hint" in refused.message and gate.refused == 1


def test_a_peer_held_to_its_hint_is_refused_past_it_without_reading():
    """Without tokens the client is its address (only the handler sees it): the stream is
    held, or refused past the gate's bound, before its first message is read; the refusal
    goes REFUSE_UNREAD_AFTER_S after the stream came, so that the client's Start has been
    written (grpc/grpc#36066)."""

    class Peer(_Context):
        def peer(self):
            return "ipv4:10.1.2.3:4567"

        def invocation_metadata(self):
            return ()

    async def run():
        service = SpeculativeService(ReplicaSet([NOWHERE]), MODEL, sequence_factory=FakeTriton)
        service.gate.max_held = 0
        service.gate.told("ipv4:10.1.2.3", 5_000)
        requests, context = _Watched(), Peer()
        t0 = time.perf_counter()
        with pytest.raises(_Aborted):
            await anext(service.Generate(requests, context))
        waited = time.perf_counter() - t0
        await service.close()
        return requests.read, context, service, waited

    read, context, service, waited = asyncio.run(run())
    assert context.status == grpc.StatusCode.RESOURCE_EXHAUSTED and read == 0
    assert waited >= REFUSE_UNREAD_AFTER_S
    assert 0 < int(dict(context.trailing)[RETRY_AFTER_KEY]) <= 5_000
    assert service.admission.open == 0  # never admitted


def test_gateway_holds_a_client_to_its_hint_unread_and_serves_others():
    """A stream refused over its client's KV quota sets the gate; the client's next stream,
    opened at once, is held without its Start being read, while another token is served; once
    the hint has run out (and the quota has room) it is served."""
    # 256 positions a client; reclaim off: the hint is the held session's expected end, long
    admission = Admission(KV, kv_per_client=256 * KV.bytes_per_token, reclaim_after_s=None)
    admission.mean_session_s = 20.0

    async def stream(stub, token: str, prompt_len: int):
        call = stub.Generate(metadata=(("authorization", f"Bearer {token}"),), timeout=60)
        await call.write(_split_start(prompt_len))
        return call

    async def until(predicate) -> None:
        while not predicate():
            await asyncio.sleep(0.01)

    async def run():
        security = Security(tokens=(b"t1", b"t2"))
        server, port, service = await start_gateway(
            NOWHERE, MODEL, sequence_factory=FakeTriton, security=security, admission=admission
        )
        m = service.metrics.registry
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.SpeculativeDecodingStub(channel)
                held = await stream(stub, "t1", 200)  # 256 positions: the client's quota
                assert (await held.read()).WhichOneof("msg") == "started"
                over = await stream_end(await stream(stub, "t1", 10))
                early = await stream(stub, "t1", 10)
                await until(lambda: m.get_sample_value("specsplit_held_streams_now") == 1)
                other = await stream(stub, "t2", 10)  # its own quota, no gate
                served = (await other.read()).WhichOneof("msg")
                prompt_tokens = m.get_sample_value("specsplit_prompt_tokens_total")
                for call in (held, other):
                    call.cancel()
                await until(lambda: not admission.live)
                service.gate.not_before.clear()  # the hint ran out
                late = (await early.read()).WhichOneof("msg")
                early.cancel()
                return over, served, prompt_tokens, late, m
        finally:
            await server.stop(grace=None)
            await service.close()

    over, served, prompt_tokens, late, m = asyncio.run(run())
    assert over[0] == grpc.StatusCode.RESOURCE_EXHAUSTED and "KV quota" in over[1]
    assert served == "started" and late == "started"
    assert prompt_tokens == 220  # 200 + 10 + 10: the held stream's Start was not decoded
    refused = "specsplit_refused_streams_total"
    assert m.get_sample_value(refused, {"reason": "client_kv"}) == 1
    assert m.get_sample_value("specsplit_held_streams_total") == 1


def _split_start(prompt_len: int) -> pb.ClientMessage:
    start = pb.Start(
        protocol_version=PROTOCOL_VERSION,
        prompt_ids=[1 + i % 3 for i in range(prompt_len)],
        sampling=pb.SamplingParams(max_new_tokens=8),
    )
    return pb.ClientMessage(start=start)
