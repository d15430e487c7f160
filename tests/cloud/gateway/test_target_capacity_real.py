"""The target's KV capacity and leases on a real tritonserver (issue 39, item 3): every START
reports the capacity and what the target holds; a START past the capacity is refused with
KV_CAPACITY_EXCEEDED (TargetFull at the gateway), the sessions it holds unaffected; a sequence
whose gateway left without ending it (its stream dropped, no END) is evicted once idle past its
lease instead of the target's 600 s idle limit."""

from __future__ import annotations

import asyncio

import pytest
import tritonclient.grpc.aio as aioclient

from specsplit.cloud.gateway.triton_client import SessionLost, TargetFull, TritonSequence
from specsplit.cloud.kv_growth import MIN_SLOT, KVShape
from specsplit.cloud.supervision.process import CloudProcess
from specsplit.shared.acceptance import VerificationRule
from specsplit.shared.sampling import SamplingConfig

pytestmark = pytest.mark.slow
SLOTS = 4  # the capacity: four fresh slots of the tiny target
LEASE_S = 1.0


@pytest.fixture(scope="module")
def small(tiny, tmp_path_factory):
    capacity_mib = SLOTS * MIN_SLOT * KVShape.from_dir(tiny.target).bytes_per_token / 2**20
    mp = pytest.MonkeyPatch()
    mp.setenv("SPECSPLIT_KV_CAPACITY_MIB", repr(capacity_mib))  # the tritonserver inherits it
    try:
        args = ["--target", str(tiny.target)]
        with CloudProcess(*args, log_dir=tmp_path_factory.mktemp("small")) as c:
            yield c
    finally:
        mp.undo()


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
