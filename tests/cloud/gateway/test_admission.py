"""Admission by KV memory and per-token quotas: the accounting, and the gateway's use of it."""

from __future__ import annotations

import asyncio
import contextlib
import random

import grpc
import pytest
import torch

from specsplit.cloud.engine.kv_slots import KVSlots
from specsplit.cloud.gateway.admission import (
    RECLAIM_AFTER_S,
    RETRY_AFTER_KEY,
    RETRY_PUSHBACK_KEY,
    Admission,
    KVShape,
    Reclaimed,
    Reclaiming,
    Refused,
    slot_positions,
)
from specsplit.cloud.gateway.security import Security, client_key
from specsplit.shared.protocol import PROTOCOL_VERSION, pb, pb_grpc
from specsplit.shared.tiny import make_tiny_qwen2
from tests.cloud.gateway.fakes import FakeControl
from tests.fakes import gateway, stream_end

KV = KVShape(layers=2, kv_heads=2, head_dim=16, dtype_bytes=4)  # the tiny test model: 512 B
MIB = 2**20


def test_bytes_per_token_match_the_targets_slots(tmp_path):
    model = make_tiny_qwen2(tmp_path / "tiny", seed=0)
    shape = KVShape.from_dir(model)
    slots = KVSlots(shape.layers, shape.kv_heads, shape.head_dim, torch.float32, "cpu")
    assert shape == KV
    assert shape.bytes_per_token == slots.bytes_per_token
    assert KVShape.from_dir(model, "bfloat16").bytes_per_token == slots.bytes_per_token // 2


@pytest.mark.parametrize("seed", range(5))
def test_reservation_is_what_a_slot_grows_to(seed):
    """Prefill in chunks of up to 256, then verification blocks of 1..17 positions: the slot
    ends exactly as large as the admission reserved for its longest length."""
    rng = random.Random(seed)
    slots = KVSlots(2, 2, 16, torch.float32, torch.device("cpu"))
    slot = slots.open(1)
    length = 0
    for step in range(rng.randrange(1, 60)):
        length += rng.randrange(1, 257) if step < 3 else rng.randrange(1, 18)
        slots.reserve(slot, length)
        slot.length = length - rng.randrange(0, 2)  # a rejected draft rolls back
        assert slot.capacity == slot_positions(length)
        assert slots.bytes_held == slot_positions(length) * KV.bytes_per_token


def test_slot_positions():
    assert [slot_positions(n) for n in (1, 64, 65, 128, 129, 1000)] == [64, 64, 128, 128, 256, 1024]


def test_budget_refuses_with_a_retry_hint_and_frees_once():
    per_session = slot_positions(100 + 16) * KV.bytes_per_token  # 128 positions: 64 KiB
    admission = Admission(KV, budget_bytes=3 * per_session)
    tickets = [admission.enter(None) for _ in range(4)]
    for t in tickets[:3]:
        t.reserve(100)
    with pytest.raises(Refused) as refused:
        tickets[3].reserve(100)
    assert "KV memory budget full" in refused.value.message
    assert "retry in" in refused.value.message
    hint = dict(refused.value.trailing_metadata())
    assert int(hint[RETRY_PUSHBACK_KEY]) > 0 and hint[RETRY_AFTER_KEY] == hint[RETRY_PUSHBACK_KEY]
    tickets[0].free()
    tickets[0].free()  # a second end of the same session gives nothing back
    assert admission.reserved_bytes == 2 * per_session
    tickets[3].reserve(100)
    for t in tickets[1:]:
        t.free()
    assert admission.reserved_bytes == 0 and not admission.live


def test_without_a_kv_shape_ended_sessions_still_leave_the_live_list():
    """Admission() (no KV shape: nothing to budget) still tracks live sessions, whose age the
    session limit's retry hint reads; each must leave when Triton frees it."""
    admission = Admission()
    tickets = [admission.enter(None) for _ in range(3)]
    for t in tickets:
        t.reserve(50)
    assert len(admission.live) == 3 and admission.reserved_bytes == 0
    for t in tickets:
        t.free()
        t.free()
    assert not admission.live


def test_a_short_session_fits_where_a_long_one_does_not():
    admission = Admission(KV, budget_bytes=MIB)  # 2048 positions of 512 B
    admission.enter(None).reserve(1000)  # 1024 positions
    with pytest.raises(Refused):
        admission.enter(None).reserve(1100)
    admission.enter(None).reserve(500)  # 1024 more: exactly the budget


def test_quota_counts_each_client_streams():
    admission = Admission(per_client=2)
    a1, _ = admission.enter("a"), admission.enter("a")
    admission.enter("b")
    with pytest.raises(Refused) as refused:
        admission.enter("a")
    assert "quota of 2" in refused.value.message and not refused.value.trailing_metadata()
    a1.leave()
    a1.leave()
    admission.enter("a")
    with pytest.raises(Refused):
        admission.enter("a")


def test_kv_quota_caps_what_one_client_reserves():
    """Streams are not cost: within its stream quota, one client with long prompts held the
    whole budget. Its KV quota stops it, and another client still finds room."""
    admission = Admission(KV, budget_bytes=8192 * KV.bytes_per_token, kv_per_client=2048 * 512)
    a = [admission.enter("a") for _ in range(3)]
    a[0].reserve(1000)  # 1024 positions
    a[1].reserve(1000)  # 1024 more: exactly the quota
    with pytest.raises(Refused) as refused:
        a[2].reserve(10)  # 64 more would exceed it
    assert "KV quota" in refused.value.message
    assert refused.value.retry_after_ms is not None  # a's own sessions ending make room
    admission.enter("b").reserve(1000)  # another client is not held back by a's quota
    a[0].free()
    a[2].reserve(10)
    assert admission.client_positions["a"] == 1024 + 64
    with pytest.raises(Refused) as alone:
        admission.enter("c").reserve(2100)  # a slot of 4096 positions: more than the quota
    assert "more than this client's KV quota" in alone.value.message
    assert alone.value.retry_after_ms is None  # waiting cannot help
    admission.enter(None).reserve(2100)  # no client key (a loopback peer): no quota
    for t in a:
        t.free()
    assert "a" not in admission.client_positions


def test_a_growth_over_the_kv_quota_keeps_what_the_session_had():
    admission = Admission(KV, kv_per_client=128 * 512)
    t = admission.enter("a")
    t.reserve(40)  # 64 positions
    t.reserve(100)  # 128: the quota
    with pytest.raises(Refused):
        t.reserve(200)  # 256
    assert t.positions == 128 and admission.client_positions["a"] == 128


def test_client_key_hides_the_token_and_drops_the_port():
    key = client_key(b"s3cret", "ipv4:10.0.0.1:5000", by_token=True)
    assert key.startswith("token:") and "s3cret" not in key
    assert key == client_key(b"s3cret", "ipv4:10.0.0.2:6000", by_token=True)
    assert client_key(None, "ipv4:10.0.0.1:5000", by_token=False) == "ipv4:10.0.0.1"
    assert client_key(None, "ipv6:[2001:db8::1]:5000", by_token=False) == "ipv6:[2001:db8::1]"


def test_loopback_and_unix_peers_are_not_counted():
    """A local client, or a local proxy whose clients all share its address."""
    for peer in ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000", "ipv6:[::ffff:127.0.0.1]:1", "unix:/s"):
        assert client_key(None, peer, by_token=False) is None


@contextlib.asynccontextmanager
async def connected(**gateway_kw):
    async with gateway(**gateway_kw) as address, grpc.aio.insecure_channel(address) as channel:
        yield pb_grpc.SpeculativeDecodingStub(channel)


def _start(max_new_tokens: int, prompt_len: int = 3) -> pb.ClientMessage:
    sampling = pb.SamplingParams(max_new_tokens=max_new_tokens)
    prompt = [1 + i % 3 for i in range(prompt_len)]
    start = pb.Start(protocol_version=PROTOCOL_VERSION, prompt_ids=prompt, sampling=sampling)
    return pb.ClientMessage(start=start)


async def served_once(stub, patience_s: float = 10.0) -> list[pb.ServerMessage]:
    """A short generation, retried while the budget is still held (freed asynchronously)."""
    for _ in range(int(patience_s / 0.1)):
        try:
            return [m async for m in stub.Generate(iter([_start(8)]), timeout=20)]
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            await asyncio.sleep(0.1)
    raise AssertionError(f"not served within {patience_s} s")


def test_gateway_refuses_over_budget_and_releases_every_reservation():
    admission = Admission(KV, budget_bytes=256 * KV.bytes_per_token)

    async def run():
        async with connected(admission=admission) as stub:
            held = stub.Generate(timeout=20)  # a prompt of 200 (+ 16): 256 positions, the budget
            await held.write(_start(8, prompt_len=200))
            assert (await held.read()).WhichOneof("msg") == "started"
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in stub.Generate(iter([_start(8)]), timeout=20):
                    pass
            held.cancel()
            served = await served_once(stub)
        return refused.value, served

    refused, served = asyncio.run(run())
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "KV memory budget full" in refused.details()
    hint = dict(refused.trailing_metadata())
    assert int(hint[RETRY_PUSHBACK_KEY]) > 0 and hint[RETRY_AFTER_KEY] == hint[RETRY_PUSHBACK_KEY]
    assert served[-1].WhichOneof("msg") == "finished"
    assert admission.reserved_bytes == 0 and not admission.live


def test_gateway_quota_per_token():
    admission = Admission(per_client=1)
    security = Security(tokens=(b"t1", b"t2"))

    async def stream(stub, token: str):
        return stub.Generate(metadata=(("authorization", f"Bearer {token}"),), timeout=20)

    async def run():
        async with connected(admission=admission, security=security) as stub:
            first = await stream(stub, "t1")
            await first.write(_start(200))
            await first.read()
            other = await stream(stub, "t2")  # another token has its own quota
            await other.write(_start(4))
            assert (await other.read()).WhichOneof("msg") == "started"
            again = await stream(stub, "t1")
            await again.write(_start(4))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await again.read()
            first.cancel()
            other.cancel()
        return refused.value

    refused = asyncio.run(run())
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "quota of 1" in refused.details() and "t1" not in refused.details()


def test_without_a_budget_the_client_quota_is_a_share_of_the_reported_capacity():
    slot = slot_positions(100 + 16) * KV.bytes_per_token
    admission = Admission(KV, kv_per_client_share=0.25)
    early = admission.enter("a")
    early.reserve(100)  # nothing reported yet: no budget, no quota (the target refuses)
    assert admission.client_kv_quota is None and admission.limit_bytes is None
    admission.observe_capacity("r1", 8 * slot, slot)  # ours
    assert admission.client_kv_quota == 2 * slot and admission.limit_bytes == 8 * slot
    admission.enter("a").reserve(100)
    with pytest.raises(Refused) as refused:
        admission.enter("a").reserve(100)
    assert refused.value.reason == "client_kv" and "KV quota of" in refused.value.message
    admission.enter("b").reserve(100)  # another client: its own quarter
    with pytest.raises(ValueError, match="share"):
        Admission(KV, kv_per_client_share=1.5)


def test_serve_flags_build_the_admission(tmp_path):
    from specsplit.cloud.cli import _admission, _parser

    model = make_tiny_qwen2(tmp_path / "tiny", seed=0)
    args = _parser().parse_args(["serve", "--kv-budget-mib", "2", "--sessions-per-client", "3"])
    admission = _admission(args, model)
    assert admission.budget_bytes == 2 * MIB and admission.per_client == 3
    assert admission.kv == KV
    default = _admission(_parser().parse_args(["serve"]), model)
    assert default.budget_bytes > 0 and default.per_client == 16  # a quarter of 64 places
    assert default.reclaim_after_s == RECLAIM_AFTER_S
    assert default.kv_per_client == default.budget_bytes // 4
    kv_flags = ["serve", "--kv-budget-mib", "8", "--kv-per-client-mib", "3"]
    assert _admission(_parser().parse_args(kv_flags), model).kv_per_client == 3 * MIB
    kv_off = _admission(_parser().parse_args(["serve", "--kv-per-client-mib", "0"]), model)
    assert kv_off.kv_per_client is None
    with pytest.raises(ValueError, match="kv-per-client-mib"):
        _admission(_parser().parse_args(["serve", "--kv-per-client-mib", "-1"]), model)
    small = _admission(_parser().parse_args(["serve", "--max-sessions", "2"]), model)
    assert small.per_client == 1
    off = ["serve", "--sessions-per-client", "0", "--reclaim-idle-after", "0.5"]
    off = _admission(_parser().parse_args(off), model)
    assert off.per_client is None and off.reclaim_after_s == 0.5
    with pytest.raises(ValueError, match="kv-budget-mib"):
        _admission(_parser().parse_args(["serve", "--kv-budget-mib", "0"]), model)
    # Targets elsewhere: their reported capacity is the budget, this host's memory is not.
    remote = _admission(_parser().parse_args(["serve", "--triton-url", "triton:8001"]), model)
    assert remote.budget_bytes is None and remote.kv_per_client is None
    assert remote.kv_per_client_share == 0.25
    capped = ["serve", "--triton-url", "triton:8001", "--kv-budget-mib", "8"]
    capped = _admission(_parser().parse_args(capped), model)
    assert capped.budget_bytes == 8 * MIB and capped.kv_per_client == 2 * MIB
    with pytest.raises(ValueError, match="sessions-per-client"):
        _admission(_parser().parse_args(["serve", "--sessions-per-client", "-1"]), model)
    with pytest.raises(ValueError, match="reclaim-idle-after"):
        _admission(_parser().parse_args(["serve", "--reclaim-idle-after", "-1"]), model)


# -- idle streams yield under pressure (the reclaim policy) --------------------------------


def _stream(admission: Admission, ended: list, idle_s: float, started: bool = True):
    """A stream idle for ``idle_s``; ``ended`` records the order the policy ends streams in."""
    ticket = admission.enter(None)
    ticket.started = started
    ticket.active -= idle_s
    ticket.attach(FakeControl(ended, ticket))
    return ticket


def test_a_full_server_ends_streams_without_start_first_then_the_least_recently_active():
    admission = Admission(max_sessions=3, reclaim_after_s=1.0)
    ended: list = []
    recent = _stream(admission, ended, idle_s=5)
    silent = _stream(admission, ended, idle_s=2, started=False)
    oldest = _stream(admission, ended, idle_s=10)
    with pytest.raises(Reclaiming):
        admission.enter(None)
    assert ended == [silent]
    with pytest.raises(Reclaiming):  # ending: waited for, no second stream reclaimed for it
        admission.enter(None)
    assert ended == [silent] and admission.reclaims == 1
    silent.leave()
    fresh = admission.enter(None)
    fresh.attach(FakeControl(ended, fresh))  # just opened: within its grace
    with pytest.raises(Reclaiming):
        admission.enter(None)
    assert ended == [silent, oldest]
    oldest.leave()
    admission.enter(None)
    assert recent not in ended and admission.open == 3


def test_streams_within_the_grace_or_at_work_are_never_reclaimed():
    admission = Admission(max_sessions=3, reclaim_after_s=1.0)
    ended: list = []
    _stream(admission, ended, idle_s=0.5)  # within its grace
    verifying = _stream(admission, ended, idle_s=10)
    unowned = admission.enter(None)  # no way to end it (no control attached): never reclaimed
    unowned.active -= 10
    with verifying.working():  # a verification in flight, however long it has taken
        verifying.active -= 10
        with pytest.raises(Refused) as refused:
            admission.enter(None)
    assert not isinstance(refused.value, Reclaiming) and not ended
    assert "limit of 3 sessions" in refused.value.message
    # The hint: when the stream within its grace may be reclaimed, not when sessions end.
    assert 100 <= refused.value.retry_after_ms <= 600
    with pytest.raises(Reclaiming):  # the verification ended long ago: idle again
        verifying.active -= 10
        admission.enter(None)
    assert ended == [verifying]


def test_the_reclaim_policy_reaches_a_stream_only_through_its_control():
    """Admission ends a stream by its StreamControl's reclaim, once; a stream that left has
    none, so nothing ends it from outside any more; a control is attached once."""
    admission = Admission(max_sessions=2, reclaim_after_s=1.0)
    idle, control = admission.enter(None), FakeControl()
    idle.attach(control)
    idle.active -= 5
    with pytest.raises(AssertionError, match="attached once"):
        idle.attach(FakeControl())
    admission.enter(None)  # the last place: no reclaim for this one
    assert control.calls == []
    with pytest.raises(Reclaiming):  # full: the idle stream is reclaimed
        admission.enter(None)
    assert control.calls == ["reclaim"] and idle.reclaimed
    idle.leave()
    assert idle.control is None and admission.open == 1


def test_without_a_grace_idle_streams_keep_their_places():
    admission = Admission(max_sessions=1, reclaim_after_s=None)
    ended: list = []
    _stream(admission, ended, idle_s=1000)
    with pytest.raises(Refused) as refused:
        admission.enter(None)
    assert not isinstance(refused.value, Reclaiming) and not ended


def test_a_reclaimed_stream_gives_back_its_place_and_kv_exactly_once():
    per_session = slot_positions(100 + 16) * KV.bytes_per_token
    admission = Admission(KV, budget_bytes=2 * per_session, max_sessions=2, reclaim_after_s=0)
    ended: list = []
    victim = _stream(admission, ended, idle_s=1)
    victim.reserve(100)
    other = _stream(admission, ended, idle_s=0.5)
    other.reserve(100)
    with pytest.raises(Reclaiming):
        admission.enter(None)
    assert ended == [victim]
    with pytest.raises(Reclaimed), victim.working():  # work that raced the reclaim never starts
        pass
    for _ in range(2):  # the handler's finally, and a second end of the same stream
        victim.leave()
        victim.free()
    assert admission.open == 1 and admission.reserved_bytes == per_session
    assert admission.live == [other]
    admission.enter(None).reserve(100)
    assert admission.reserved_bytes == 2 * per_session


def test_kv_budget_reclaims_the_fewest_idle_sessions_that_make_room():
    per_session = slot_positions(100 + 16) * KV.bytes_per_token  # 128 positions
    admission = Admission(KV, budget_bytes=4 * per_session, reclaim_after_s=1.0)
    ended: list = []
    sessions = [_stream(admission, ended, idle_s=idle) for idle in (3, 9, 5, 0)]
    for s in sessions:
        s.reserve(100)
    silent = _stream(admission, ended, idle_s=50, started=False)  # holds no KV: no help here
    newcomer = admission.enter(None)
    newcomer.attach(FakeControl(ended, newcomer))
    newcomer.active -= 100  # idle as can be, yet never reclaimed for its own Start
    with pytest.raises(Reclaiming):
        newcomer.reserve(200)  # 256 positions: two sessions' worth
    assert ended == [sessions[1], sessions[2]]  # least recently active; 0 s idle is in its grace
    with pytest.raises(Reclaiming):  # their KV is still held: wait for Triton to free it
        newcomer.reserve(200)
    for s in ended:
        s.leave()
    with pytest.raises(Reclaiming):  # left, but Triton has not freed them yet
        newcomer.reserve(200)
    for s in list(ended):
        s.free()
    newcomer.reserve(200)
    assert admission.reserved_bytes == 4 * per_session and silent not in ended
    with pytest.raises(Refused) as refused:  # even both idle ones left would not make room
        admission.enter(None).reserve(1000)
    assert not isinstance(refused.value, Reclaiming) and len(ended) == 2


def _silent(stub, send_start: bool):
    """A stream that sends a Start (or nothing) and then stays silent: (call, its status)."""
    call = stub.Generate(timeout=30)

    async def hold() -> tuple[grpc.StatusCode, str]:
        if send_start:
            await call.write(_start(200))
        return await stream_end(call)

    return call, asyncio.create_task(hold())


@pytest.mark.parametrize("send_start", [True, False])
def test_gateway_ends_idle_streams_with_unavailable_to_serve_a_fresh_one(send_start):
    admission = Admission(max_sessions=2, reclaim_after_s=0.3)

    async def run():
        async with connected(admission=admission) as stub:
            holders = [_silent(stub, send_start) for _ in range(2)]
            try:
                await asyncio.sleep(0.6)  # both idle beyond the grace
                t0 = asyncio.get_running_loop().time()
                served = [m async for m in stub.Generate(iter([_start(8)]), timeout=20)]
                waited = asyncio.get_running_loop().time() - t0
                tasks = [task for _, task in holders]
                done, _ = await asyncio.wait(tasks, timeout=5, return_when="FIRST_COMPLETED")
                ends = [task.result() for task in done]
            finally:
                for call, _ in holders:
                    call.cancel()
                await asyncio.gather(*(task for _, task in holders), return_exceptions=True)
            for _ in range(100):  # the cancelled holder's place is given back asynchronously
                if admission.open == 0:
                    break
                await asyncio.sleep(0.02)
        return served, waited, ends

    served, waited, ends = asyncio.run(run())
    assert served[0].WhichOneof("msg") == "started" and served[-1].WhichOneof("msg") == "finished"
    assert waited < 1.0
    assert len(ends) == 1 and ends[0][0] == grpc.StatusCode.UNAVAILABLE
    assert "committed sequence" in ends[0][1]
    assert admission.reclaims == 1 and admission.open == 0 and not admission.live
