"""The target's KV capacity (issue 39, item 3): an Open or a step whose slot would grow past it
is refused (KVCapacityExceeded, retryable) and the others are served; an out-of-memory pass is
run again without the session that caused it; a session idle past its lease is evicted."""

import numpy as np
import pytest

from specsplit.cloud.engine.target import (
    PREFILLING,
    KVCapacityExceeded,
    Open,
    TargetModel,
    Verify,
)
from specsplit.cloud.kv_growth import MIN_SLOT
from specsplit.shared.tiny import reference_greedy
from tests.cloud.engine.conftest import GREEDY


def _target(target_dir, slots: int | None = None) -> TargetModel:
    """A tiny target that may hold ``slots`` fresh (MIN_SLOT-position) slots."""
    probe = TargetModel(target_dir, device="cpu", calibrate=False, weights="float")
    if slots is None:
        return probe
    capacity = slots * MIN_SLOT * probe.forward.slots.bytes_per_token
    return TargetModel(
        target_dir, device="cpu", calibrate=False, weights="float", kv_capacity=capacity
    )


def test_capacity_defaults_to_the_device_and_must_be_positive(target_dir):
    assert _target(target_dir).kv_ledger.kv_capacity > 0
    with pytest.raises(ValueError, match="KV capacity"):
        TargetModel(target_dir, device="cpu", calibrate=False, weights="float", kv_capacity=-1)


def test_an_open_past_the_capacity_is_refused_and_the_others_served(target_dir):
    target = _target(target_dir, slots=2)
    outcomes, _ = target.run(
        [Open(1, [1, 2, 3], GREEDY), Open(2, [4, 5, 6], GREEDY), Open(3, [7, 8, 9], GREEDY)]
    )
    assert outcomes[:2] == [None, None]
    assert isinstance(outcomes[2], KVCapacityExceeded) and "retry" in str(outcomes[2])
    assert 3 not in target.sessions
    assert target.kv_ledger.kv_bytes <= target.kv_ledger.kv_capacity
    [v], _ = target.run([Verify(1, 3, [3])])
    assert v.result.token == reference_greedy(target_dir, [1, 2, 3], 1)[0]


def test_a_step_past_the_capacity_is_refused_the_session_intact(target_dir):
    target = _target(target_dir, slots=2)
    long = np.random.default_rng(0).integers(0, 256, size=MIN_SLOT).tolist()
    target.run([Open(1, long, GREEDY), Open(2, [4, 5, 6], GREEDY)])
    # Session 1 holds 63 positions of its 64: a block of 3 needs the next slot (2 x 64 more).
    outcomes, _ = target.run([Verify(1, MIN_SLOT, [long[-1], 5, 6]), Verify(2, 3, [6])])
    assert isinstance(outcomes[0], KVCapacityExceeded)
    assert outcomes[1].result.token == reference_greedy(target_dir, [4, 5, 6], 1)[0]
    assert target.sessions[1].cache_len == MIN_SLOT - 1  # as it was
    target.end(2)  # room again: the same step goes through
    [v], _ = target.run([Verify(1, MIN_SLOT, [long[-1]])])
    assert v.result.token == reference_greedy(target_dir, long, 1)[0]


def test_an_out_of_memory_pass_is_retried_without_its_cause(target_dir, monkeypatch):
    target = _target(target_dir)
    target.run([Open(s, [1 + s, 2, 3], GREEDY) for s in range(3)])
    culprit = target.sessions[1].slot
    forward = target.forward
    calls = []

    class Failing:
        slots = forward.slots

        def __call__(self, segments):
            calls.append(len(segments))
            if any(seg.slot is culprit for seg in segments):
                raise MemoryError("out of memory")
            return forward(segments)

    monkeypatch.setattr(target, "forward", Failing())
    # The culprit's block is the largest: it is the one left out.
    requests = [Verify(0, 3, [3]), Verify(1, 3, [3, 4, 5, 6]), Verify(2, 3, [3])]
    outcomes, _ = target.run(requests)
    assert isinstance(outcomes[1], KVCapacityExceeded)
    for s in (0, 2):
        assert outcomes[s].result.token == reference_greedy(target_dir, [1 + s, 2, 3], 1)[0]
    assert calls == [3, 2]
    assert target.sessions[1].cache_len == 2  # as it was: it can step again
    monkeypatch.setattr(target, "forward", forward)
    [v], _ = target.run([Verify(1, 3, [3])])
    assert v.result.token == reference_greedy(target_dir, [2, 2, 3], 1)[0]


def test_an_out_of_memory_prefill_fails_its_open_alone(target_dir, monkeypatch):
    target = _target(target_dir)
    target.run([Open(2, [4, 5, 6], GREEDY)])
    forward = target.forward

    class Failing:
        slots = forward.slots

        def __call__(self, segments):
            if any(len(seg.tokens) > 10 for seg in segments):
                raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return forward(segments)

    monkeypatch.setattr(target, "forward", Failing())
    outcomes, _, finished = target.step([Open(1, list(range(50)), GREEDY), Verify(2, 3, [6])])
    assert outcomes[0] is PREFILLING
    assert outcomes[1].result.token == reference_greedy(target_dir, [4, 5, 6], 1)[0]
    [(sid, error)] = finished
    assert sid == 1 and isinstance(error, KVCapacityExceeded)
    assert 1 not in target.sessions and not target.prefills


def test_a_session_idle_past_its_lease_is_evicted(target_dir):
    target = _target(target_dir)
    target.run([Open(1, [1, 2, 3], GREEDY, lease_s=90), Open(2, [1, 2, 3], GREEDY)])
    for session in target.sessions.values():
        session.last_used -= 120  # both idle for 2 minutes
    assert target.evict_idle(600) == [1]  # the leased one; the other keeps the idle limit
    assert list(target.sessions) == [2]


def test_a_prompt_waiting_for_its_rows_is_not_idle(target_dir):
    target = _target(target_dir)
    prompt = [i % 200 for i in range(600)]  # 599 rows: three passes
    target.step([Open(1, prompt, GREEDY, lease_s=1)])
    target.sessions[1].last_used -= 120
    assert target.evict_idle(600) == [] and 1 in target.prefills
