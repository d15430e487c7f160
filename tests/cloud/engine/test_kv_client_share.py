"""One client's share of the target's KV capacity (issue 39, item 4), counted on the target, so
it holds across every gateway: an Open or a step that would take a client past its share is
refused (KVCapacityExceeded, retryable), other clients and sessions without a client served;
a session that ends in any way gives its bytes back to its client. The real-process test is
tests/cloud/gateway/test_target_capacity_real.py."""

import math

import numpy as np
import pytest

from specsplit.cloud.engine.target import KVCapacityExceeded, Open, TargetModel, Verify
from specsplit.cloud.kv_growth import KV_PER_CLIENT_SHARE, MIN_SLOT
from specsplit.shared.tiny import reference_greedy
from tests.cloud.engine.conftest import GREEDY

ALICE, BOB = 11, 22  # CLIENT values, as the gateway hashes its clients
SLOTS = 8  # the capacity, in fresh (MIN_SLOT-position) slots: a quarter is two


@pytest.fixture(scope="module")
def slot_bytes(target_dir) -> int:
    probe = TargetModel(target_dir, device="cpu", calibrate=False, weights="float")
    return MIN_SLOT * probe.forward.slots.bytes_per_token


def _target(target_dir, slot_bytes: int, **kw) -> TargetModel:
    capacity = SLOTS * slot_bytes
    return TargetModel(
        target_dir, device="cpu", calibrate=False, weights="float", kv_capacity=capacity, **kw
    )


def _open(target: TargetModel, sid: int, client: int, prompt=(1, 2, 3), **kw):
    [outcome], _ = target.run([Open(sid, list(prompt), GREEDY, client=client, **kw)])
    return outcome


def test_the_share_defaults_to_a_quarter_and_must_be_in_0_1(target_dir, slot_bytes):
    target = _target(target_dir, slot_bytes)
    assert target.kv_ledger.kv_per_client_share == KV_PER_CLIENT_SHARE == 0.25
    assert target.kv_ledger.client_kv_quota == 2 * slot_bytes
    assert _target(target_dir, slot_bytes, kv_per_client_share=0).kv_ledger.client_kv_quota is None
    for bad in (-0.1, 1.5, math.nan):
        with pytest.raises(ValueError, match="per-client KV share"):
            _target(target_dir, slot_bytes, kv_per_client_share=bad)


def test_an_open_past_the_clients_share_is_refused_and_others_served(target_dir, slot_bytes):
    target = _target(target_dir, slot_bytes)
    assert _open(target, 1, ALICE) is None and _open(target, 2, ALICE) is None
    refused = _open(target, 3, ALICE)
    assert isinstance(refused, KVCapacityExceeded)
    message = str(refused)
    assert "client's share" in message and "retry" in message
    mib = slot_bytes / 2**20
    assert f"hold {2 * mib:.1f} MiB of the client's share of {2 * mib:.1f} MiB" in message
    assert 3 not in target.sessions
    assert target.kv_ledger.client_kv_bytes(ALICE) == 2 * slot_bytes
    assert _open(target, 4, BOB) is None  # another client still gets in
    for sid in (5, 6, 7):  # sessions without a client: the whole capacity alone
        assert _open(target, sid, 0) is None
    assert target.kv_ledger.kv_bytes == 6 * slot_bytes
    [v], _ = target.run([Verify(1, 3, [3])])  # the client's held sessions are served as before
    assert v.result.token == reference_greedy(target_dir, [1, 2, 3], 1)[0]


def test_a_session_larger_than_the_share_is_told_no_end_helps(target_dir, slot_bytes):
    target = _target(target_dir, slot_bytes)
    refused = _open(target, 1, ALICE, prompt=list(range(3 * MIN_SLOT)))  # a 4-slot slot
    assert isinstance(refused, KVCapacityExceeded) and "shorter prompt" in str(refused)
    assert _open(target, 2, 0, prompt=list(range(3 * MIN_SLOT))) is None  # no client: fits
    prompt = list(range(2 * MIN_SLOT))  # a 2-slot slot: her whole share
    assert _open(target, 3, ALICE, prompt=prompt) is None
    [refused], _ = target.run([Verify(3, 2 * MIN_SLOT, [prompt[-1], 5, 6])])  # 4 slots
    assert isinstance(refused, KVCapacityExceeded) and "cannot grow further" in str(refused)


def test_a_step_past_the_clients_share_is_refused_the_session_intact(target_dir, slot_bytes):
    target = _target(target_dir, slot_bytes)
    long = np.random.default_rng(0).integers(0, 256, size=MIN_SLOT).tolist()
    _open(target, 1, ALICE, prompt=long)  # 63 positions of its 64
    _open(target, 2, ALICE)
    _open(target, 3, BOB, prompt=long)
    # Both sessions 1 and 3 need their slot's next size (one slot more): Alice is at her share,
    # Bob is not, and the capacity has room for both.
    step = [long[-1], 5, 6]
    outcomes, _ = target.run([Verify(1, MIN_SLOT, step), Verify(3, MIN_SLOT, step)])
    assert isinstance(outcomes[0], KVCapacityExceeded) and "client's share" in str(outcomes[0])
    assert outcomes[1].result is not None
    assert target.sessions[1].cache_len == MIN_SLOT - 1  # as it was
    target.end(2)  # the client's other session ends: the same step goes through
    [v], _ = target.run([Verify(1, MIN_SLOT, step)])
    greedy = reference_greedy(target_dir, long, 3)
    accepted = 0 if greedy[0] != 5 else 1 if greedy[1] != 6 else 2
    assert (v.result.accepted, v.result.token) == (accepted, greedy[accepted])
    assert (
        target.kv_ledger.client_kv_bytes(ALICE) == 2 * slot_bytes
    )  # its grown slot: 128 positions


def test_growths_in_one_pass_count_together(target_dir, slot_bytes):
    target = _target(target_dir, slot_bytes)
    long = np.random.default_rng(1).integers(0, 256, size=MIN_SLOT).tolist()
    _open(target, 1, ALICE, prompt=long)
    _open(target, 2, ALICE, prompt=long)
    # Alice holds two slots and each step needs one more: a share of three admits one of the
    # two; a count taken once before the pass would admit both (four slots).
    target.kv_ledger.kv_per_client_share = 3 / SLOTS
    step = [long[-1], 5, 6]
    outcomes, _ = target.run([Verify(1, MIN_SLOT, step), Verify(2, MIN_SLOT, step)])
    assert outcomes[0].result is not None
    assert isinstance(outcomes[1], KVCapacityExceeded)
    assert target.kv_ledger.client_kv_bytes(ALICE) == 3 * slot_bytes


def test_a_reopen_does_not_count_its_old_slot(target_dir, slot_bytes):
    target = _target(target_dir, slot_bytes)
    _open(target, 1, ALICE)
    _open(target, 2, ALICE)
    assert _open(target, 2, ALICE, prompt=[4, 5, 6]) is None  # the same sid again
    assert target.kv_ledger.client_kv_bytes(ALICE) == 2 * slot_bytes


@pytest.mark.parametrize("ends", ["released", "evicted", "lease expired"])
def test_a_session_that_ends_gives_its_bytes_back_to_its_client(target_dir, slot_bytes, ends):
    target = _target(target_dir, slot_bytes)
    lease_s = 30.0 if ends == "lease expired" else 0.0
    _open(target, 1, ALICE, lease_s=lease_s)
    _open(target, 2, ALICE)
    assert isinstance(_open(target, 3, ALICE), KVCapacityExceeded)
    if ends == "released":
        [outcome], _ = target.run([Verify(1, 3, [3], end=True)])  # END with its last step
        assert outcome.result is not None
    else:
        target.sessions[1].last_used -= 60 if ends == "lease expired" else 900
        assert target.evict_idle(600) == [1]  # past its lease, or past the idle limit
    assert target.kv_ledger.client_kv_bytes(ALICE) == slot_bytes
    assert _open(target, 3, ALICE) is None
