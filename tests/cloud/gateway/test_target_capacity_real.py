"""The target's KV capacity and leases on a real tritonserver (issue 39, item 3): every START
reports the capacity and what the target holds; a START past the capacity is refused with
KV_CAPACITY_EXCEEDED (TargetFull at the gateway), the sessions it holds unaffected; a sequence
whose gateway left without ending it (its stream dropped, no END) is evicted once idle past its
lease instead of the target's 600 s idle limit. One client's share of the capacity holds across
gateways (issue 39, item 4): a client that holds its share through one gateway is refused a
START through another, by the target, while another client still gets in, and gets it once
its session through the first gateway ends."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import grpc
import pytest
import tritonclient.grpc.aio as aioclient

from specsplit.cloud.gateway.triton_client import SessionLost, TargetFull, TritonSequence
from specsplit.cloud.kv_growth import MIN_SLOT, KVShape
from specsplit.cloud.supervision.process import CloudProcess
from specsplit.shared.acceptance import VerificationRule
from specsplit.shared.protocol import PROTOCOL_VERSION, RETRY_AFTER_KEY, pb, pb_grpc
from specsplit.shared.sampling import SamplingConfig

pytestmark = pytest.mark.slow
SLOTS = 4  # the capacity: four fresh slots of the tiny target (a client's quarter: one)
LEASE_S = 1.0
ALICE, BOB = "alice-token", "bob-token"
# A lock-step session whose client sends no Draft: it holds its fresh slot until its stream ends.
LOCK_STEP_START = pb.ClientMessage(
    start=pb.Start(
        protocol_version=PROTOCOL_VERSION,
        prompt_ids=[1, 2, 3],
        sampling=pb.SamplingParams(max_new_tokens=8),
    )
)


@contextlib.contextmanager
def _small_serve(tiny, log_dir, *flags: str) -> Iterator[CloudProcess]:
    """`serve` whose tritonserver has a capacity of SLOTS fresh slots."""
    capacity_mib = SLOTS * MIN_SLOT * KVShape.from_dir(tiny.target).bytes_per_token / 2**20
    mp = pytest.MonkeyPatch()
    mp.setenv("SPECSPLIT_KV_CAPACITY_MIB", repr(capacity_mib))  # the tritonserver inherits it
    mp.delenv("SPECSPLIT_KV_PER_CLIENT_SHARE", raising=False)  # the model's default
    try:
        with CloudProcess("--target", str(tiny.target), *flags, log_dir=log_dir) as c:
            yield c
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def small(tiny, tmp_path_factory):
    with _small_serve(tiny, tmp_path_factory.mktemp("small")) as c:
        yield c


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokens") / "tokens.txt"
    path.write_text(f"{ALICE}\n{BOB}\n")
    return path


async def _start(client, prompt, lease_s: float = 0.0) -> TritonSequence:
    sequence = TritonSequence(client)
    sequence.lease_s = lease_s
    await sequence.start(prompt, SamplingConfig(), VerificationRule.GREEDY, seed=0)
    return sequence


def test_starts_report_the_capacity_and_past_it_are_refused(small, tiny):
    bpt = KVShape.from_dir(tiny.target).bytes_per_token

    async def run():
        client = aioclient.InferenceServerClient(small.triton_url)
        held, refused = [], None
        try:
            for n in range(SLOTS + 1):
                try:
                    held.append(await _start(client, [1, 2, 3 + n]))
                except TargetFull as e:
                    refused = e
                    break
            reports = [(s.kv_capacity, s.kv_held) for s in held]
            step = await held[0].step(3, [3])  # a held session is served as before
            for s in held:
                await s.close()
        finally:
            await client.close()
        return reports, refused, step

    reports, refused, step = asyncio.run(run())
    capacity = SLOTS * MIN_SLOT * bpt
    assert [c for c, _ in reports] == [capacity] * SLOTS
    assert [h for _, h in reports] == [(i + 1) * MIN_SLOT * bpt for i in range(SLOTS)]
    assert refused is not None and "KV_CAPACITY_EXCEEDED" in str(refused)
    assert step.token >= 0


def test_a_sequence_left_without_an_end_is_evicted_after_its_lease(small):
    async def run():
        client = aioclient.InferenceServerClient(small.triton_url)
        try:
            orphan = await _start(client, [1, 2, 3], lease_s=LEASE_S)
            kept = await _start(client, [4, 5, 6])  # no lease: the idle limit alone
            await asyncio.sleep(3 * LEASE_S)  # its gateway is gone: nothing renews the lease
            probe = await _start(client, [7, 8, 9])  # a pass runs: idle sessions are evicted
            lost = None
            try:
                await orphan.step(3, [3])
            except SessionLost as e:
                lost = e
            step = await kept.step(3, [6])
            for s in (kept, probe):
                await s.close()
        finally:
            await client.close()
        return lost, step

    lost, step = asyncio.run(run())
    assert lost is not None
    assert step.token >= 0


@pytest.fixture(scope="module")
def two_gateways(small, tiny, tokens, tmp_path_factory):
    """Two gateway processes in front of the small target, as deploy/k8s runs them behind
    Envoy; both take Alice's and Bob's tokens, so each counts them as clients."""
    args = ["--triton-url", small.triton_url, "--target", str(tiny.target)]
    args += ["--auth-tokens", str(tokens)]
    with (
        CloudProcess(*args, log_dir=tmp_path_factory.mktemp("gateway-a")) as a,
        CloudProcess(*args, log_dir=tmp_path_factory.mktemp("gateway-b")) as b,
    ):
        yield a.address, b.address


async def _session(channel: grpc.aio.Channel, token: str):
    """(the open call, None) once Started, or (None, the refusal)."""
    stub = pb_grpc.SpeculativeDecodingStub(channel)
    call = stub.Generate(metadata=(("authorization", f"Bearer {token}"),), timeout=120)
    await call.write(LOCK_STEP_START)
    try:
        msg = await call.read()
    except grpc.aio.AioRpcError as e:
        return None, e
    assert msg is not grpc.aio.EOF and msg.WhichOneof("msg") == "started", msg
    return call, None


def test_a_clients_share_holds_across_gateways(two_gateways):
    address_a, address_b = two_gateways

    async def run():
        async with (
            grpc.aio.insecure_channel(address_a) as a,
            grpc.aio.insecure_channel(address_b) as b,
        ):
            alice_a, refused = await _session(a, ALICE)  # her share, through gateway A
            assert refused is None, refused
            # Gateway B holds none of Alice's sessions: only the target knows she is at her share.
            none, refused = await _session(b, ALICE)
            assert none is None
            bob_b, bob_refused = await _session(b, BOB)  # another client still gets in
            alice_a.cancel()  # her session on A ends: the target gives her bytes back
            again, tries = None, 0
            while again is None and tries < 20:  # as an edge retries: after each hint
                tries += 1
                again, e = await _session(b, ALICE)
                if again is None:
                    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                    hint = dict(e.trailing_metadata() or ()).get(RETRY_AFTER_KEY, "100")
                    await asyncio.sleep(int(hint) / 1e3)
            for call in (bob_b, again):
                if call is not None:
                    call.cancel()
            return refused, bob_refused, again

    refused, bob_refused, again = asyncio.run(run())
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "client's share" in refused.details(), refused.details()
    assert RETRY_AFTER_KEY in dict(refused.trailing_metadata() or ())
    assert bob_refused is None, bob_refused
    assert again is not None


def test_serve_without_a_kv_quota_starts_its_targets_without_one(tiny, tokens, tmp_path):
    """`serve --kv-per-client-mib 0` turns the per-client KV quota off on the targets it starts
    as well as on its gateway: one client may hold more than a quarter of the capacity."""
    flags = ("--auth-tokens", str(tokens), "--kv-per-client-mib", "0")

    async def run(address):
        async with grpc.aio.insecure_channel(address) as channel:
            sessions = [await _session(channel, ALICE) for _ in range(2)]
            for call, _ in sessions:
                if call is not None:
                    call.cancel()
            return [refused for _, refused in sessions]

    with _small_serve(tiny, tmp_path, *flags) as c:
        refusals = asyncio.run(run(c.address))
    assert refusals == [None, None], refusals
