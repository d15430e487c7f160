"""Bad input on the real gateway + Triton: a precise status, and the server keeps serving."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specsplit.cloud.supervision.process import CloudProcess
from specsplit.shared.protocol import PROTOCOL_VERSION, SERVICE_NAME, pb, pb_grpc

pytestmark = pytest.mark.slow
VOCAB = 256  # tests/tiny_models default


CLOUD_ONLY, CLOUD_LED = pb.SESSION_MODE_CLOUD_ONLY, pb.SESSION_MODE_CLOUD_LED


def start(prompt=(1, 2, 3), **kw) -> pb.ClientMessage:
    sampling = kw.pop("sampling", pb.SamplingParams(max_new_tokens=8))
    fields = dict(protocol_version=PROTOCOL_VERSION, prompt_ids=list(prompt), sampling=sampling)
    fields.update(kw)
    return pb.ClientMessage(start=pb.Start(**fields))


def draft(base_len, tokens, round_no=1, q=()) -> pb.ClientMessage:
    return pb.ClientMessage(
        draft=pb.Draft(round=round_no, base_len=base_len, tokens=list(tokens), q=list(q))
    )


def exchange(address: str, messages: list[pb.ClientMessage]) -> list[pb.ServerMessage]:
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.SpeculativeDecodingStub(channel)
        return list(stub.Generate(iter(messages), timeout=60))


def expect_error(address, messages, code: grpc.StatusCode, match: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        exchange(address, messages)
    assert err.value.code() == code, err.value.details()
    assert match in err.value.details()


def assert_still_serving(address: str) -> None:
    out = exchange(address, [start(), draft(3, [5, 6])])
    assert out[0].WhichOneof("msg") == "started"
    assert out[-1].WhichOneof("msg") == "finished"


def q_of(token: int, prob: float = 1.0) -> pb.SparseDistribution:
    return pb.SparseDistribution(token_ids=[token], probs=[prob])


HOT = pb.SamplingParams(temperature=0.8, max_new_tokens=8)
CASES = {
    "prompt id outside vocab": (
        [start(prompt=(1, VOCAB))],
        grpc.StatusCode.INVALID_ARGUMENT,
        "outside the vocabulary",
    ),
    "empty prompt": ([start(prompt=())], grpc.StatusCode.INVALID_ARGUMENT, "at least one token"),
    "draft id outside vocab": (
        [start(), draft(3, [1, VOCAB + 5])],
        grpc.StatusCode.INVALID_ARGUMENT,
        "outside the vocab",
    ),
    "oversized block": (
        [start(), draft(3, list(range(17)))],
        grpc.StatusCode.INVALID_ARGUMENT,
        "max_draft_tokens",
    ),
    "wrong base_len": ([start(), draft(7, [1])], grpc.StatusCode.FAILED_PRECONDITION, "base_len"),
    "stale base_len in round 2": (
        [start(), draft(3, [1]), draft(3, [1], round_no=2)],
        grpc.StatusCode.FAILED_PRECONDITION,
        "base_len 3 != committed_len",
    ),
    "draft before start": ([draft(3, [1])], grpc.StatusCode.FAILED_PRECONDITION, "must be Start"),
    "second start": ([start(), start()], grpc.StatusCode.FAILED_PRECONDITION, "unexpected start"),
    "unknown model": ([start(model="gpt-17")], grpc.StatusCode.NOT_FOUND, "unknown model"),
    "protocol version": (
        [start(protocol_version=0)],
        grpc.StatusCode.FAILED_PRECONDITION,
        "protocol_version",
    ),
    "negative temperature": (
        [start(sampling=pb.SamplingParams(temperature=-1, max_new_tokens=4))],
        grpc.StatusCode.INVALID_ARGUMENT,
        "temperature",
    ),
    "max_new_tokens 0": (
        [start(sampling=pb.SamplingParams())],
        grpc.StatusCode.INVALID_ARGUMENT,
        "max_new_tokens",
    ),
    "greedy rule with temperature": (
        [start(sampling=HOT, verification=pb.VERIFICATION_RULE_GREEDY)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "temperature 0",
    ),
    "rejection without q": (
        [start(sampling=HOT), draft(3, [1, 2])],
        grpc.StatusCode.INVALID_ARGUMENT,
        "needs q",
    ),
    "q not a distribution": (
        [start(sampling=HOT), draft(3, [1], q=[q_of(1, 0.5)])],
        grpc.StatusCode.INVALID_ARGUMENT,
        "sum to 1",
    ),
    "draft outside q support": (
        [start(sampling=HOT), draft(3, [1], q=[q_of(2)])],
        grpc.StatusCode.INVALID_ARGUMENT,
        "outside q[0]",
    ),
    "q under the greedy rule": (
        [start(), draft(3, [1], q=[q_of(1)])],
        grpc.StatusCode.INVALID_ARGUMENT,
        "only sent under the rejection rule",
    ),
    "draft in cloud-only": (
        [
            start(sampling=pb.SamplingParams(max_new_tokens=400), session_mode=CLOUD_ONLY),
            draft(3, [1]),
        ],
        grpc.StatusCode.FAILED_PRECONDITION,
        "cloud-only",
    ),
    "unknown session mode": (
        [start(session_mode=7)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "unknown session_mode 7",
    ),
    "cloud-led draft past committed_len": (
        [
            start(sampling=pb.SamplingParams(max_new_tokens=400), session_mode=CLOUD_LED),
            draft(10**6, [1]),
        ],
        grpc.StatusCode.FAILED_PRECONDITION,
        "> committed_len",
    ),
    "lead in a cloud-led session": (
        [
            start(sampling=pb.SamplingParams(max_new_tokens=400), session_mode=CLOUD_LED),
            pb.ClientMessage(draft=pb.Draft(round=1, base_len=3, tokens=[1], lead=True)),
        ],
        grpc.StatusCode.INVALID_ARGUMENT,
        "only valid in a lock-step session",
    ),
    "cloud-led q not a distribution": (
        [
            start(
                sampling=pb.SamplingParams(temperature=0.8, max_new_tokens=400),
                session_mode=CLOUD_LED,
            ),
            draft(3, [1], q=[q_of(1, 0.5)]),
        ],
        grpc.StatusCode.INVALID_ARGUMENT,
        "sum to 1",
    ),
    "infinite temperature": (
        [start(sampling=pb.SamplingParams(temperature=float("inf"), max_new_tokens=4))],
        grpc.StatusCode.INVALID_ARGUMENT,
        "temperature",
    ),
    "temperature that overflows the logits": (
        [start(sampling=pb.SamplingParams(temperature=1e-30, max_new_tokens=4))],
        grpc.StatusCode.INVALID_ARGUMENT,
        "temperature",
    ),
    "nan top_p": (
        [start(sampling=pb.SamplingParams(temperature=0.8, top_p=float("nan"), max_new_tokens=4))],
        grpc.StatusCode.INVALID_ARGUMENT,
        "top_p",
    ),
    "unknown verification rule": (
        [start(verification=7)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "verification rule",
    ),
    "prompt fills max_context": (
        [start(prompt=[1] * 1024)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "max_context",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_gets_precise_status(cloud, case):
    messages, code, match = CASES[case]
    expect_error(cloud.address, messages, code, match)
    assert_still_serving(cloud.address)


def test_valid_exchange_shape(cloud):
    out = exchange(cloud.address, [start(), draft(3, [5, 6, 7])])
    started, verdict, finished = out[0].started, out[1].verdict, out[-1].finished
    assert started.model.vocab_size == VOCAB and started.committed_len == 3
    assert started.limits.max_draft_tokens >= 8
    assert verdict.round == 1 and 0 <= verdict.accepted <= 3 and verdict.has_token
    assert verdict.committed_len == 3 + verdict.accepted + 1
    assert verdict.timings.verify_ms > 0
    assert finished.target_forward_passes >= 1


def test_a_lead_draft_turns_the_stream_cloud_led(cloud):
    """Draft.lead: its verdict is a lock-step round's, then the cloud steps on without Drafts
    (the client half-closed: it only listens) to the requested length."""
    lead = pb.ClientMessage(draft=pb.Draft(round=1, base_len=3, tokens=[5, 6], lead=True))
    out = exchange(cloud.address, [start(), lead])
    assert out[0].started.accepts_lead
    verdicts = [m.verdict for m in out if m.WhichOneof("msg") == "verdict"]
    assert verdicts[0].round == 1 and verdicts[0].drafts_verified == 2
    assert len(verdicts) > 1 and all(v.round == 0 for v in verdicts[1:])
    assert verdicts[-1].finished and verdicts[-1].committed_len == 3 + 8
    assert out[-1].finished.target_forward_passes == len(verdicts)


def test_started_reports_its_setup_and_the_recent_step(cloud):
    exchange(cloud.address, [start(), draft(3, [5, 6])])  # at least one target pass
    started = exchange(cloud.address, [start(), draft(3, [5])])[0].started
    assert started.setup_ms > 0 and started.step_ms > 0


def test_finish_ends_generation_early(cloud):
    out = exchange(cloud.address, [start(), draft(3, [5]), pb.ClientMessage(finish=pb.Finish())])
    assert out[-1].finished.reason == pb.FINISH_REASON_CANCELLED


def test_health_service_reports_serving(cloud):
    with grpc.insecure_channel(cloud.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for name in ("", SERVICE_NAME):
            resp = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_triton_down_gives_unavailable(tiny, tmp_path):
    from specsplit.cloud.supervision.triton import free_port

    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    with CloudProcess(
        "--target", str(tiny.target), "--triton-url", dead, log_dir=tmp_path
    ) as gateway_only:
        expect_error(gateway_only.address, [start()], grpc.StatusCode.UNAVAILABLE, "unavailable")
        with grpc.insecure_channel(gateway_only.address) as channel:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=10
            )
        assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING


def test_finish_in_cloud_only_is_not_overwritten(cloud):
    """An explicit Finish ends a cloud-only stream as CANCELLED, however a round is in flight."""

    async def run() -> list[pb.ServerMessage]:
        async with grpc.aio.insecure_channel(cloud.address) as channel:
            call = pb_grpc.SpeculativeDecodingStub(channel).Generate(timeout=60)
            await call.write(
                start(sampling=pb.SamplingParams(max_new_tokens=400), session_mode=CLOUD_ONLY)
            )
            out = [await call.read(), await call.read()]  # Started, a first Verdict
            await call.write(pb.ClientMessage(finish=pb.Finish()))
            await call.done_writing()
            while (msg := await call.read()) is not grpc.aio.EOF:
                out.append(msg)
            return out

    out = asyncio.run(run())
    verdicts = [m.verdict for m in out if m.WhichOneof("msg") == "verdict"]
    assert out[-1].finished.reason == pb.FINISH_REASON_CANCELLED
    assert len(verdicts) < 400 and not any(v.finished for v in verdicts)


def test_top_k_beyond_the_vocabulary_means_no_truncation(cloud):
    """top_k >= vocab_size keeps every token (read as 0); it used to wrap to a negative int32."""
    big = pb.SamplingParams(temperature=0.8, top_k=2**31, max_new_tokens=4, seed=1)
    none = pb.SamplingParams(temperature=0.8, top_k=0, max_new_tokens=4, seed=1)
    token_only = pb.VERIFICATION_RULE_TOKEN_ONLY
    a = exchange(cloud.address, [start(sampling=big, verification=token_only), draft(3, [5])])
    b = exchange(cloud.address, [start(sampling=none, verification=token_only), draft(3, [5])])
    assert a[-1].finished == b[-1].finished and a[1].verdict.token == b[1].verdict.token
    greedy = pb.SamplingParams(top_k=2**32 - 1, max_new_tokens=4)
    assert exchange(cloud.address, [start(sampling=greedy)])[0].WhichOneof("msg") == "started"


def test_max_new_tokens_is_capped_to_max_context(cloud):
    huge = pb.SamplingParams(max_new_tokens=2**32 - 1)
    out = exchange(cloud.address, [start(sampling=huge), pb.ClientMessage(finish=pb.Finish())])
    assert out[0].started.max_new_tokens == out[0].started.limits.max_context - 3


@pytest.mark.parametrize("first", [b"\xff", start().SerializeToString()])
def test_undecodable_payload_is_invalid_argument(cloud, first):
    with grpc.insecure_channel(cloud.address) as channel:
        generate = channel.stream_stream("/specsplit.v1.SpeculativeDecoding/Generate")
        with pytest.raises(grpc.RpcError) as err:
            list(generate(iter([first, b"\xff"]), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert_still_serving(cloud.address)
