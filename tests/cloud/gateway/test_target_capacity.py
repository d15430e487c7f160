"""The gateway against the target's own KV capacity (issue 39, item 3): admission counts against
the smaller of its budget and the room the target reported (its capacity less what other
gateways hold there); the target's refusal reaches the edge as RESOURCE_EXHAUSTED with a retry
hint (retried by edge/retry.py), not INTERNAL; each sequence carries its lease."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from specsplit.cloud.gateway.admission import Admission, KVShape, Refused, slot_positions
from specsplit.cloud.gateway.service import LEASE_MARGIN_S
from specsplit.cloud.gateway.stream_policy import StreamPolicy
from specsplit.cloud.gateway.triton_client import TargetFull, _classify
from specsplit.edge.client import GenerationConfig, SplitClient
from specsplit.shared.protocol import (
    PROTOCOL_VERSION,
    RETRY_AFTER_KEY,
    SESSION_MODE_TO_PB,
    pb,
    pb_grpc,
)
from specsplit.shared.session_mode import SessionMode
from tests.fakes import FakeTriton, gateway, stream_end

KV = KVShape(layers=2, kv_heads=2, head_dim=16, dtype_bytes=4)  # 512 B a position
SLOT = slot_positions(100 + 16) * KV.bytes_per_token  # a session at 100 tokens: 64 KiB
START = pb.ClientMessage(
    start=pb.Start(
        protocol_version=PROTOCOL_VERSION,
        prompt_ids=[1, 2, 3],
        sampling=pb.SamplingParams(max_new_tokens=8),
        session_mode=SESSION_MODE_TO_PB[SessionMode.CLOUD_ONLY],
    )
)


def test_admission_counts_against_the_targets_room():
    admission = Admission(KV, budget_bytes=100 * SLOT)
    first = admission.enter(None)
    first.reserve(100)
    # The target may hold 4 slots and holds 3: ours and two of another gateway's.
    admission.observe_capacity("r1", 4 * SLOT, 3 * SLOT)
    assert admission.limit_bytes == 2 * SLOT  # 4 less the other gateway's 2
    admission.enter(None).reserve(100)
    with pytest.raises(Refused) as refused:
        admission.enter(None).reserve(100)
    assert "KV memory budget full" in refused.value.message
    assert refused.value.retry_after_ms is not None  # the other gateway's sessions end
    admission.observe_capacity("r1", 4 * SLOT, SLOT)  # they did
    admission.enter(None).reserve(100)


def test_a_session_larger_than_the_targets_capacity_is_refused_without_a_hint():
    admission = Admission(KV, budget_bytes=100 * SLOT)
    admission.observe_capacity("r1", SLOT, 0)
    with pytest.raises(Refused) as refused:
        admission.enter(None).reserve(1000)
    assert refused.value.retry_after_ms is None and "whole KV budget" in refused.value.message


def test_a_target_that_does_not_report_leaves_the_budget():
    admission = Admission(KV, budget_bytes=2 * SLOT)
    admission.observe_capacity("r1", None, None)
    assert admission.limit_bytes == 2 * SLOT and admission.capacity_bytes is None


def test_the_targets_refusal_is_classified_retryable():
    error = _classify(RuntimeError("[StatusCode.INTERNAL] KV_CAPACITY_EXCEEDED: session 3: ..."))
    assert isinstance(error, TargetFull)


def test_the_targets_refusal_reaches_the_edge_with_a_retry_hint():
    leases = []

    class Full(FakeTriton):
        async def start(self, prompt, sampling, verification, seed: int, speculative: bool = True):
            leases.append(self.lease_s)

        async def step(self, base_len, tokens, q=None):
            raise TargetFull("KV_CAPACITY_EXCEEDED: session 1: its next step needs 1.0 MiB")

    async def run():
        policy = StreamPolicy(idle_timeout_s=20)
        async with (
            gateway(Full, policy=policy) as address,
            grpc.aio.insecure_channel(address) as channel,
        ):
            call = pb_grpc.SpeculativeDecodingStub(channel).Generate(iter([START]), timeout=30)
            code, details = await stream_end(call)
            return code, details, dict(await call.trailing_metadata())

    code, details, trailers = asyncio.run(run())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    assert "the target refused more KV memory" in details and "retry in" in details
    assert int(trailers[RETRY_AFTER_KEY]) > 0
    assert leases == [20 + LEASE_MARGIN_S]


def test_the_edge_retries_the_targets_refusal_and_loses_no_token():
    """The target refuses one step for want of KV memory; the edge re-opens from its committed
    sequence when the hint says, and the generation ends with every token."""
    refusals = []

    class FullOnce(FakeTriton):
        async def step(self, base_len, tokens, q=None):
            if base_len == 10 and not refusals:
                refusals.append(base_len)
                raise TargetFull("KV_CAPACITY_EXCEEDED: session 1: its next step needs 1 MiB")
            return await super().step(base_len, tokens, q)

    async def run():
        async with gateway(FullOnce) as address, SplitClient(address) as client:
            cfg = GenerationConfig(max_new_tokens=20, retry_window_s=20.0)
            gen = client.generate([1, 2, 3], cfg, "cloud-only")
            async for _ in gen:
                pass
            return gen

    gen = asyncio.run(run())
    assert refusals == [10] and gen.stats.retries >= 1
    assert gen.token_ids == [7] * 20


def test_serve_tells_its_own_targets_the_gateways_share():
    """The targets `serve` starts enforce the share its --kv-per-client-mib gives of its budget
    (0: off, as the gateway's), by default their own quarter, as the gateway's."""
    from specsplit.cloud.cli import _parser, _target_kv_share

    def share(*flags: str) -> float | None:
        args = _parser().parse_args(["serve", *flags])
        return _target_kv_share(args, int(args.kv_budget_mib * 2**20))

    assert share("--kv-budget-mib", "8") is None
    assert share("--kv-budget-mib", "8", "--kv-per-client-mib", "0") == 0
    assert share("--kv-budget-mib", "8", "--kv-per-client-mib", "4") == 0.5
    assert share("--kv-budget-mib", "8", "--kv-per-client-mib", "16") == 1.0
