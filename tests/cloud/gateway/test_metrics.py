"""Gateway metrics: in-process with fakes for the counting rules, then on real parts (tritonserver,
`specsplit-cloud serve --metrics-port`, ONNX Runtime) where they must equal the edge's own stats."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specsplit.cloud.gateway.metrics import ACCEPTANCE_LENGTHS, GatewayMetrics
from specsplit.cloud.gateway.service import start_gateway
from specsplit.cloud.gateway.triton_client import VerifyReply
from specsplit.cloud.supervision.process import CloudProcess
from specsplit.cloud.supervision.triton import free_port
from specsplit.edge.client import GenerationConfig, SplitClient
from specsplit.edge.generation import GenerationStats
from specsplit.edge.mode_switch import LeadChoice
from specsplit.edge.onnx_drafter import OnnxDrafter
from specsplit.shared.protocol import PROTOCOL_VERSION, pb, pb_grpc
from specsplit.shared.sampling import SamplingConfig
from specsplit.shared.spec_counts import StepCounts
from tests.fakes import MODEL, NOWHERE, FakeTriton


class AcceptsTwo(FakeTriton):
    """Keeps the first two drafts of every block, then answers token 9."""

    async def verify(self, base_len: int, tokens: Sequence[int], q=None) -> VerifyReply:
        kept = min(2, len(tokens) - 1)
        return VerifyReply(
            accepted=kept, token=9, verify_ms=2.0, roundtrip_ms=3.0, batch_rows=4, batch_sessions=1
        )


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
    assert value(m, "specsplit_rounds_total", mode="split") == 2
    assert value(m, "specsplit_tokens_committed_total", mode="split") == 4
    assert value(m, "specsplit_sessions_total", mode="split", outcome="length") == 1
    assert value(m, "specsplit_sessions_active") == 0
    assert value(m, "specsplit_round_verify_seconds_count") == 2
    assert value(m, "specsplit_round_verify_seconds_sum") == pytest.approx(0.004)
    assert value(m, "specsplit_target_batch_rows_sum") == 8
    sent = sum(msg.ByteSize() for msg in messages)
    assert value(m, "specsplit_received_bytes_total") == sent
    assert value(m, "specsplit_sent_bytes_total") > 0
    assert not any(name == "specsplit_errors_total" for name, _ in m)


def test_errors_are_counted_by_status_code():
    async def main():
        async with gateways(1) as [(address, service)]:
            bad_version = await stream(address, [start(4, version=99)])
            bad_base = await stream(address, [start(4), draft(2, [5])])
            return (bad_version, bad_base), await settled_registry(service)

    codes, m = asyncio.run(main())
    assert codes == (grpc.StatusCode.FAILED_PRECONDITION,) * 2
    assert value(m, "specsplit_errors_total", code="FAILED_PRECONDITION") == 2
    assert value(m, "specsplit_sessions_total", mode="split", outcome="failed_precondition") == 2


def test_calls_refused_for_their_token_are_counted():
    from specsplit.cloud.gateway.security import Security

    async def main():
        security = Security(tokens=(b"good",))
        server, port, service = await start_gateway(
            NOWHERE, MODEL, sequence_factory=FakeTriton, security=security
        )
        try:
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
        finally:
            await server.stop(grace=None)
            await service.close()

    codes, m = asyncio.run(main())
    refused = grpc.StatusCode.UNAUTHENTICATED
    assert codes == [refused, refused, grpc.StatusCode.OK]
    assert value(m, "specsplit_errors_total", code="UNAUTHENTICATED") == 2
    assert value(m, "specsplit_sessions_total", mode="none", outcome="unauthenticated") == 2
    assert value(m, "specsplit_sessions_total", mode="split", outcome="client_closed") == 1


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
                if value(m, "specsplit_sessions_total", mode="split", outcome="client_cancelled"):
                    break
                await asyncio.sleep(0.05)
            return m, service.active

    m, active = asyncio.run(main())
    assert value(m, "specsplit_sessions_total", mode="split", outcome="client_cancelled") == 1
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
    s = GenerationStats(mode="split")
    for k, accepted, emitted in [(3, 3, 4), (3, 1, 2), (2, 0, 1), (0, 0, 1)]:
        s.observe_step(StepCounts(k, accepted, emitted))
    out = s.summary()
    assert out["num_drafts"] == 3
    assert out["num_emitted_tokens"] == 7
    assert out["mean_acceptance_length"] == pytest.approx(7 / 3)
    assert out["accepted_per_position"] == [2, 1, 1]
    assert out["acceptance_rate_per_position"] == [2 / 3, 1 / 3, 1 / 2]
    assert out["acceptance_histogram"] == [1, 1, 0, 1]


# --- real parts -------------------------------------------------------------------------------


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


@dataclass(frozen=True)
class MeteredCloud:
    """`specsplit-cloud serve --metrics-port` with the tiny target, and the drafts to use."""

    address: str
    metrics_url: str
    log_path: Path
    same: OnnxDrafter  # the target as its own draft: (nearly) everything accepted
    unrelated: OnnxDrafter  # another model: next to nothing accepted

    def read(self) -> dict:
        return settled(lambda: samples(scrape(self.metrics_url)))


@pytest.fixture(scope="module")
def metered_cloud(tiny, tmp_path_factory):
    """One cloud for every real-parts test of this module, stopped after the last one."""
    port = free_port()
    args = ("--target", str(tiny.target), "--metrics-port", str(port))
    with CloudProcess(*args, log_dir=tmp_path_factory.mktemp("metered")) as cloud:
        yield MeteredCloud(
            cloud.address,
            f"http://127.0.0.1:{port}/metrics",
            cloud.log_path,
            OnnxDrafter(tiny.target_onnx),
            OnnxDrafter(tiny.draft_onnx),
        )


async def generate(address, drafter, prompt, mode, **cfg) -> GenerationStats:
    async with SplitClient(address, drafter) as client:
        gen = client.generate(prompt, GenerationConfig(**cfg), mode=mode)
        await gen.collect()
        return gen.stats


def delta(before: dict, after: dict) -> dict:
    """What each sample grew by between two reads."""
    return {key: v - before.get(key, 0.0) for key, v in after.items()}


SPEC = "specsplit_spec_decode"


def disagreements(d: dict, stats: GenerationStats, label: str) -> dict[str, tuple]:
    """{figure: (gateway's counter delta, the client's stats)} wherever the two differ."""
    summary = stats.summary()
    pairs = {
        "draft_tokens": (value(d, f"{SPEC}_num_draft_tokens_total"), stats.drafted),
        "accepted": (value(d, f"{SPEC}_num_accepted_tokens_total"), stats.accepted),
        "drafts": (value(d, f"{SPEC}_num_drafts_total"), summary["num_drafts"]),
        "emitted": (value(d, f"{SPEC}_num_emitted_tokens_total"), summary["num_emitted_tokens"]),
        "acceptance_length_count": (
            value(d, f"{SPEC}_acceptance_length_count"),
            len(stats.emitted_lens),
        ),
        "acceptance_length_sum": (
            value(d, f"{SPEC}_acceptance_length_sum"),
            sum(stats.emitted_lens),
        ),
        "committed": (value(d, "specsplit_tokens_committed_total", mode=label), stats.new_tokens),
        "rounds": (value(d, "specsplit_rounds_total", mode=label), stats.rounds),
        "verify_seconds_count": (value(d, "specsplit_round_verify_seconds_count"), stats.rounds),
        "received_bytes": (value(d, "specsplit_received_bytes_total"), stats.bytes_up),
        "sent_bytes": (value(d, "specsplit_sent_bytes_total"), stats.bytes_down),
        "sessions_length": (
            value(d, "specsplit_sessions_total", mode=label, outcome="length"),
            1 if stats.finish == "LENGTH" else 0,
        ),
    }
    per_pos = summary["accepted_per_position"]
    for pos in range(16):
        gateway = value(d, f"{SPEC}_num_accepted_tokens_per_pos_total", position=str(pos))
        pairs[f"accepted_at_{pos}"] = (gateway, per_pos[pos] if pos < len(per_pos) else 0)
    for le in ACCEPTANCE_LENGTHS:
        gateway = value(d, f"{SPEC}_acceptance_length_bucket", le=f"{float(le)}")
        pairs[f"acceptance_length_le_{le}"] = (gateway, sum(e <= le for e in stats.emitted_lens))
    return {name: pair for name, pair in pairs.items() if pair[0] != pair[1]}


# Session modes as GenerationConfig asks for them. A seeded sampled run neither adapts nor leaves
# lock-step unless told to (it must repeat exactly): adaptive=True lets it, as greedy runs do.
SESSION_CONFIGS = {
    "lock-step-fixed-k": dict(session_mode="lock-step", adaptive=False),
    "lock-step-adaptive": dict(session_mode="lock-step", adaptive=True),
    # follow_hint=False: the tiny target's cost model may hint k = 0 (its pass is all lm_head
    # rows), and a cloud-led edge that obeys drafts nothing, leaving the counters untested.
    "cloud-led": dict(session_mode="cloud-led", follow_hint=False),
    "auto": dict(session_mode="auto", adaptive=True),  # switches to cloud-led mid-stream
    "cloud-only": {},
}
SAMPLINGS = {
    "greedy": {},
    "sampled": dict(sampling=SamplingConfig(temperature=0.8), seed=1234),
}


ATTEMPTS = 5


@pytest.mark.slow
@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("session", SESSION_CONFIGS)
def test_counters_equal_the_clients_stats_on_real_parts(
    metered_cloud, session, sampling, monkeypatch
):
    cloud = metered_cloud
    cloud_only = session == "cloud-only"
    mode = label = "cloud-only" if cloud_only else "split"
    if session == "auto":
        # Start lock-step whatever Start's round trip says (on loopback it may already favour
        # leading with the first Draft): the hand-over then comes mid-stream, from the rounds'
        # own measurements.
        monkeypatch.setattr(LeadChoice, "lead_at_start", staticmethod(lambda *_: False))
    cfg = dict(max_new_tokens=21, **SESSION_CONFIGS[session], **SAMPLINGS[sampling])
    # The target as its own draft accepts most, the unrelated draft next to nothing (its
    # cloud-led Drafts mostly go stale); cloud-only has no draft. Counters are read around each
    # generation.
    drafts = (
        {"target-only": (None, [5, 6], 4)}
        if cloud_only
        else {
            "same": (cloud.same, [1, 2, 3], 4),
            "unrelated": (cloud.unrelated, [42, 7], 3),
        }
    )
    # A cloud-led step verifies only Drafts that reach past what the cloud committed: a tiny
    # target steps about as fast as the edge drafts, so one run may verify none. Such runs are
    # repeated (each still checked) until Drafts were verified, at most ATTEMPTS times.
    attempts = ATTEMPTS if session == "cloud-led" else 1
    for _ in range(attempts):
        runs, wrong = [], {}
        for name, (drafter, prompt, k) in drafts.items():
            before = cloud.read()
            stats = asyncio.run(
                generate(cloud.address, drafter, prompt, mode, draft_tokens=k, **cfg)
            )
            if found := disagreements(delta(before, cloud.read()), stats, label):
                wrong[name] = found
            runs.append(stats)
        assert not wrong, (
            f"gateway counter deltas != client stats, {{figure: (gateway, client)}}: {wrong}"
        )
        if sum(s.drafted for s in runs) and sum(s.drafts_dropped for s in runs):
            break
    assert all(s.finish == "LENGTH" and s.new_tokens == 21 for s in runs)
    drafted, accepted = sum(s.drafted for s in runs), sum(s.accepted for s in runs)
    if cloud_only:
        assert drafted == 0
    elif session.startswith("lock-step"):  # every Draft is verified: the unrelated one fails
        assert 0 < accepted < drafted
    else:  # cloud-led: which Drafts a step verifies depends on timing (stale ones are not)
        assert drafted > 0 and accepted <= drafted
    if session == "cloud-led":  # stale Drafts came, and were drafted on neither side
        assert sum(s.drafts_dropped for s in runs) > 0
    if session == "auto":  # lock-step rounds first, then the hand-over to cloud-led
        assert any(s.lead_round > 1 for s in runs)
    elif session.startswith("lock-step"):
        assert not any(s.lead_round or s.drafts_sent or s.drafts_dropped for s in runs)


@pytest.mark.slow
def test_triton_reports_its_own_metrics(metered_cloud):
    # Triton's own metrics are on (localhost): it counted the requests to the target.
    asyncio.run(generate(metered_cloud.address, None, [5, 6], "cloud-only", max_new_tokens=3))
    triton = re.search(
        r"triton \S+ metrics on (http://127\.0\.0\.1:\d+/metrics)",
        metered_cloud.log_path.read_text(),
    )
    assert triton, "serve must report Triton's own metrics address"
    assert re.search(
        r'nv_inference_request_success\{model="target",version="1"\} [1-9]', scrape(triton[1])
    )
    assert value(metered_cloud.read(), "specsplit_triton_replicas_up") == 1
