"""Gateway metrics in-process with fakes: the counting rules (their real-parts check, where they
must equal the edge's own stats, is test_metrics_real_parts.py)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import urllib.request
from collections.abc import Sequence

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specsplit.cloud.gateway.metrics import GatewayMetrics
from specsplit.cloud.gateway.service import start_gateway
from specsplit.cloud.gateway.triton_client import StepReply
from specsplit.edge.generation import GenerationStats
from specsplit.shared.protocol import PROTOCOL_VERSION, SESSION_MODE_TO_PB, pb, pb_grpc
from specsplit.shared.session_mode import SessionMode
from specsplit.shared.spec_counts import StepCounts
from tests.fakes import MODEL, NOWHERE, FakeTriton


class AcceptsTwo(FakeTriton):
    """Keeps the first two drafts of every block, then answers token 9."""

    async def step(self, base_len: int, tokens: Sequence[int], q=None) -> StepReply:
        kept = min(2, len(tokens) - 1)
        return StepReply(
            accepted=kept, token=9, verify_ms=2.0, roundtrip_ms=3.0, batch_rows=4, batch_sessions=1
        )


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def samples(registry_or_text) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} from a registry or an exposition text."""
    if isinstance(registry_or_text, str):
        families = text_string_to_metric_families(registry_or_text)
    else:
        families = registry_or_text.collect()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


def value(found: dict, name: str, **labels) -> float:
    return found.get((name, tuple(sorted(labels.items()))), 0.0)


def settled(read) -> dict:
    """``read()``'s samples once every stream's handler has finished its bookkeeping (polled, for
    up to 10 s): a client can hear its status a moment before the gateway's handler returns and
    counts the session."""
    for _ in range(200):
        m = read()
        if value(m, "specsplit_sessions_active") == 0:
            break
        time.sleep(0.05)
    return m


async def settled_registry(service) -> dict:
    """``settled`` on a gateway of this event loop, which keeps running while we poll."""
    return await asyncio.to_thread(settled, lambda: samples(service.metrics.registry))


@contextlib.asynccontextmanager
async def gateways(n: int, factory=FakeTriton):
    started = [await start_gateway(NOWHERE, MODEL, sequence_factory=factory) for _ in range(n)]
    try:
        yield [(f"127.0.0.1:{port}", service) for _, port, service in started]
    finally:
        for server, _, service in started:
            await server.stop(grace=None)
            await service.close()


async def stream(address: str, messages: list[pb.ClientMessage]) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(address) as channel:
        call = pb_grpc.SpeculativeDecodingStub(channel).Generate(iter(messages), timeout=20)
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as e:
            return e.code()
        return grpc.StatusCode.OK


def start(max_new_tokens: int, version: int = PROTOCOL_VERSION) -> pb.ClientMessage:
    params = pb.SamplingParams(max_new_tokens=max_new_tokens)
    return pb.ClientMessage(
        start=pb.Start(protocol_version=version, prompt_ids=[1, 2, 3], sampling=params)
    )


def draft(base_len: int, tokens: list[int]) -> pb.ClientMessage:
    return pb.ClientMessage(draft=pb.Draft(round=1, base_len=base_len, tokens=tokens))


def test_counters_follow_the_protocol_in_vllm_vocabulary():
    # Round 1: k=3, two kept + token 9 (3 tokens). Round 2: k=0, token 9 only: length reached.
    messages = [start(max_new_tokens=4), draft(3, [5, 6, 7]), draft(6, [])]

    async def main():
        async with gateways(1, AcceptsTwo) as [(address, service)]:
            assert await stream(address, messages) == grpc.StatusCode.OK
            return await settled_registry(service)

    m = asyncio.run(main())
    spec = "specsplit_spec_decode"
    assert value(m, f"{spec}_num_drafts_total") == 1  # the k=0 round is not a draft
    assert value(m, f"{spec}_num_draft_tokens_total") == 3
    assert value(m, f"{spec}_num_accepted_tokens_total") == 2
    assert value(m, f"{spec}_num_emitted_tokens_total") == 3
    assert value(m, f"{spec}_num_accepted_tokens_per_pos_total", position="0") == 1
    assert value(m, f"{spec}_num_accepted_tokens_per_pos_total", position="1") == 1
    assert value(m, f"{spec}_num_accepted_tokens_per_pos_total", position="2") == 0
    assert value(m, f"{spec}_acceptance_length_sum") == 3
    assert value(m, f"{spec}_acceptance_length_bucket", le="2.0") == 0
    assert value(m, f"{spec}_acceptance_length_bucket", le="3.0") == 1
    assert value(m, "specsplit_rounds_total", route="split") == 2
    assert value(m, "specsplit_tokens_committed_total", route="split") == 4
    assert value(m, "specsplit_sessions_total", route="split", outcome="length") == 1
    assert value(m, "specsplit_sessions_active") == 0
    assert value(m, "specsplit_round_verify_seconds_count") == 2
    assert value(m, "specsplit_round_verify_seconds_sum") == pytest.approx(0.004)
    assert value(m, "specsplit_target_batch_rows_sum") == 8
    sent = sum(msg.ByteSize() for msg in messages)
    assert value(m, "specsplit_received_bytes_total") == sent
    assert value(m, "specsplit_sent_bytes_total") > 0
    assert not any(name == "specsplit_errors_total" for name, _ in m)


def test_request_latency_and_token_counters_in_vllm_names():
    """What operators alert on first: time to first token, inter-token and end-to-end latency,
    queue time; prompt and generation tokens."""
    params = pb.SamplingParams(max_new_tokens=5)
    cloud_only = pb.ClientMessage(
        start=pb.Start(
            protocol_version=PROTOCOL_VERSION,
            prompt_ids=[1, 2, 3, 4],
            sampling=params,
            session_mode=SESSION_MODE_TO_PB[SessionMode.CLOUD_ONLY],
        )
    )

    async def main():
        async with gateways(1) as [(address, service)]:
            codes = [await stream(address, [cloud_only]) for _ in range(2)]
            return codes, await settled_registry(service)

    codes, m = asyncio.run(main())
    assert codes == [grpc.StatusCode.OK] * 2
    assert value(m, "specsplit_prompt_tokens_total") == 2 * 4
    assert value(m, "specsplit_generation_tokens_total") == 2 * 5  # one token a Verdict
    for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert value(m, f"specsplit_{name}_seconds_count") == 2, name
    assert value(m, "specsplit_inter_token_latency_seconds_count") == 2 * 4  # between 5 Verdicts
    e2e, ttft = (
        value(m, f"specsplit_{n}_seconds_sum")
        for n in ("e2e_request_latency", "time_to_first_token")
    )
    assert 0 < ttft <= e2e


def test_errors_are_counted_by_status_code():
    async def main():
        async with gateways(1) as [(address, service)]:
            bad_version = await stream(address, [start(4, version=99)])
            bad_base = await stream(address, [start(4), draft(2, [5])])
            return (bad_version, bad_base), await settled_registry(service)

    codes, m = asyncio.run(main())
    assert codes == (grpc.StatusCode.FAILED_PRECONDITION,) * 2
    assert value(m, "specsplit_errors_total", code="FAILED_PRECONDITION") == 2
    assert value(m, "specsplit_sessions_total", route="split", outcome="failed_precondition") == 2


@contextlib.asynccontextmanager
async def token_gateway(token: bytes = b"good"):
    """An in-process gateway that requires ``token``: (its port, its service)."""
    from specsplit.cloud.gateway.security import Security

    security = Security(tokens=(token,))
    server, port, service = await start_gateway(
        NOWHERE, MODEL, sequence_factory=FakeTriton, security=security
    )
    try:
        yield port, service
    finally:
        await server.stop(grace=None)
        await service.close()


def test_a_refused_token_lets_the_clients_writes_go_first():
    """A wrong token is refused from the call's metadata, nothing read, but REFUSE_UNREAD_AFTER_S
    after the call came: ending it while the client's Start is still being written would show the
    client INTERNAL instead of UNAUTHENTICATED (grpc/grpc#36066)."""
    from specsplit.cloud.gateway.messages import REFUSE_UNREAD_AFTER_S

    async def main():
        async with (
            token_gateway() as (port, _),
            grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
        ):
            meta = (("authorization", "Bearer bad"),)
            t0 = time.perf_counter()
            call = pb_grpc.SpeculativeDecodingStub(channel).Generate(metadata=meta)
            await call.write(start(2))
            await call.done_writing()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await asyncio.wait_for(call.read(), 10)
            return time.perf_counter() - t0, e.value.code()

    waited, code = asyncio.run(main())
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert waited >= REFUSE_UNREAD_AFTER_S


def test_calls_refused_for_their_token_are_counted():
    async def main():
        async with token_gateway() as (port, service):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.SpeculativeDecodingStub(channel)
                codes = []
                for token in (None, "bad", "good"):
                    meta = (("authorization", f"Bearer {token}"),) if token else None
                    call = stub.Generate(iter([start(2)]), metadata=meta, timeout=20)
                    try:
                        async for _ in call:
                            pass
                        codes.append(grpc.StatusCode.OK)
                    except grpc.aio.AioRpcError as e:
                        codes.append(e.code())
            return codes, await settled_registry(service)

    codes, m = asyncio.run(main())
    refused = grpc.StatusCode.UNAUTHENTICATED
    assert codes == [refused, refused, grpc.StatusCode.OK]
    assert value(m, "specsplit_errors_total", code="UNAUTHENTICATED") == 2
    assert value(m, "specsplit_sessions_total", route="none", outcome="unauthenticated") == 2
    assert value(m, "specsplit_sessions_total", route="split", outcome="client_closed") == 1


def test_a_client_that_cancels_is_counted_and_its_stream_closed():
    async def main():
        async with gateways(1) as [(address, service)]:
            async with grpc.aio.insecure_channel(address) as channel:
                call = pb_grpc.SpeculativeDecodingStub(channel).Generate(timeout=20)
                await call.write(start(8))
                assert (await call.read()).WhichOneof("msg") == "started"
                call.cancel()
            for _ in range(200):  # the handler notices the cancel asynchronously
                m = samples(service.metrics.registry)
                if value(m, "specsplit_sessions_total", route="split", outcome="client_cancelled"):
                    break
                await asyncio.sleep(0.05)
            return m, service.active

    m, active = asyncio.run(main())
    assert value(m, "specsplit_sessions_total", route="split", outcome="client_cancelled") == 1
    assert value(m, "specsplit_sessions_active") == 0
    assert active == 0  # the handler's own cleanup ran too
    assert not any(name == "specsplit_errors_total" for name, _ in m)


def test_each_gateway_has_its_own_registry():
    async def main():
        async with gateways(2) as [(address, first), (_, second)]:
            await stream(address, [start(2), draft(3, [5])])
            return await settled_registry(first), samples(second.metrics.registry)

    first, second = asyncio.run(main())
    assert value(first, "specsplit_spec_decode_num_drafts_total") == 1
    assert value(second, "specsplit_spec_decode_num_drafts_total") == 0


def test_replicas_are_reported_from_the_health_watch():
    async def main():
        async with gateways(1) as [(_, service)]:
            return samples(service.metrics.registry)

    m = asyncio.run(main())  # NOWHERE has no Triton: down
    assert ("specsplit_triton_replicas_up", ()) in m
    assert value(m, "specsplit_triton_replicas_up") == 0
    assert ("specsplit_triton_replica_up", (("replica", NOWHERE),)) in m
    assert value(m, "specsplit_triton_replica_up", replica=NOWHERE) == 0


def test_metrics_without_replicas_still_register():
    assert value(samples(GatewayMetrics().registry), "specsplit_sessions_active") == 0


def test_edge_per_request_spec_decode_fields():
    s = GenerationStats(route="split")
    for k, accepted, emitted in [(3, 3, 4), (3, 1, 2), (2, 0, 1), (0, 0, 1)]:
        s.observe_step(StepCounts(k, accepted, emitted))
    out = s.summary()
    assert out["num_drafts"] == 3
    assert out["num_emitted_tokens"] == 7
    assert out["mean_acceptance_length"] == pytest.approx(7 / 3)
    assert out["accepted_per_position"] == [2, 1, 1]
    assert out["acceptance_rate_per_position"] == [2 / 3, 1 / 3, 1 / 2]
    assert out["acceptance_histogram"] == [1, 1, 0, 1]


def test_kv_capacity_and_refusals_move():
    """What the target reports (capacity, KV every gateway holds), what this gateway reserves
    and may reserve, and the streams refused for KV, as sessions come and go."""
    from specsplit.cloud.gateway.admission import Admission, KVShape, slot_positions

    kv = KVShape(layers=2, kv_heads=2, head_dim=16, dtype_bytes=4)
    slot = slot_positions(3 + 16) * kv.bytes_per_token  # the prompt's slot: 64 positions

    class Reports(FakeTriton):
        kv_capacity, kv_held = 10 * slot, 10 * slot  # full: ours and 9 of other gateways

    async def main():
        admission = Admission(kv, budget_bytes=100 * slot)
        server, port, service = await start_gateway(
            NOWHERE, MODEL, sequence_factory=Reports, admission=admission
        )
        read = lambda: samples(service.metrics.registry)  # noqa: E731
        try:
            before = read()
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.SpeculativeDecodingStub(channel)
                held = stub.Generate(timeout=20)
                await held.write(start(8))
                assert (await held.read()).WhichOneof("msg") == "started"
                during = read()
                refused = await stream(f"127.0.0.1:{port}", [start(8)])
                held.cancel()
            return before, during, refused, await settled_registry(service)
        finally:
            await server.stop(grace=None)
            await service.close()

    before, during, refused, after = asyncio.run(main())
    replica = {"replica": NOWHERE}
    assert value(before, "specsplit_kv_limit_bytes") == 100 * slot
    assert ("specsplit_target_kv_capacity_bytes", (("replica", NOWHERE),)) not in before
    assert value(during, "specsplit_target_kv_capacity_bytes", **replica) == 10 * slot
    assert value(during, "specsplit_target_kv_held_bytes", **replica) == 10 * slot
    assert value(during, "specsplit_kv_reserved_bytes") == slot
    assert value(during, "specsplit_kv_limit_bytes") == slot  # 10 less 9 of others
    assert refused == grpc.StatusCode.RESOURCE_EXHAUSTED  # the target is full
    assert value(before, "specsplit_refused_streams_total", reason="kv_budget") == 0
    assert value(after, "specsplit_refused_streams_total", reason="kv_budget") == 1
    assert value(after, "specsplit_kv_reserved_bytes") == 0
