"""What one client may cost the gateway besides sessions (issue 39, item 4): a stream without a
valid token is refused from its metadata, none of its messages read; one connection holds at most
``StreamPolicy.max_streams_per_connection`` streams. (The per-client KV quota's accounting is in
test_admission.py.)"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from specsplit.cloud.gateway.security import Security, TokenAuth
from specsplit.cloud.gateway.stream_policy import StreamPolicy
from specsplit.cloud.gateway.triton_client import TritonSequence
from specsplit.shared.acceptance import VerificationRule
from specsplit.shared.protocol import PROTOCOL_VERSION, SESSION_MODE_TO_PB, pb, pb_grpc
from specsplit.shared.sampling import SamplingConfig
from specsplit.shared.session_mode import SessionMode
from tests.fakes import FakeTriton, gateway

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
        self.status = None

    async def abort(self, code, details, trailing_metadata=()):
        self.status = code
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
