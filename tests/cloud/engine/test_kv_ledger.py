"""The KV ledger alone (``cloud.engine.kv_ledger``), on real slots and fake sessions: one pass's
earlier grants count against its later steps, a client's share holds across its sessions, and a
session that leaves the target's sessions gives its bytes back. The target's own tests
(test_kv_capacity.py, test_kv_client_share.py) drive it through ``TargetModel``."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from specsplit.cloud.engine.kv_ledger import KVCapacityExceeded, KVLedger
from specsplit.cloud.engine.kv_slots import KVSlots, Slot
from specsplit.cloud.kv_growth import MIN_SLOT

ALICE, BOB = 11, 22


@dataclass
class Session:
    slot: Slot
    client: int = 0


def _ledger(slots: float, share: float = 0.0) -> tuple[KVLedger, dict[int, Session], int]:
    """A ledger over fresh slots of 8 bytes a position, that may hold ``slots`` fresh
    (MIN_SLOT-position) slots; its sessions; a fresh slot's bytes."""
    store = KVSlots(1, 1, 1, torch.float32, torch.device("cpu"))
    fresh = MIN_SLOT * store.bytes_per_token
    sessions: dict[int, Session] = {}
    return KVLedger(store, sessions, int(slots * fresh), share), sessions, fresh


def _open(ledger: KVLedger, sessions: dict[int, Session], sid: int, client: int = 0) -> None:
    ledger.check_open(sid, client, MIN_SLOT - 1)
    sessions[sid] = Session(ledger.slots.open(sid), client)


def test_a_passes_earlier_grants_count_against_its_later_steps():
    ledger, sessions, fresh = _ledger(slots=3.5)
    for sid in (1, 2):
        _open(ledger, sessions, sid)
    # Each step needs the next slot: one fresh slot's bytes more; there is room for one.
    steps = [(1, sessions[1], MIN_SLOT + 1), (2, sessions[2], MIN_SLOT + 1)]
    granted, refused = ledger.step_refusals(steps)
    assert granted is None and isinstance(refused, KVCapacityExceeded)
    assert str(refused).startswith("session 2: its next step needs") and "retry" in str(refused)
    assert ledger.step_refusals(steps[1:]) == [None]  # alone it fits
    assert ledger.step_refusals([(1, sessions[1], MIN_SLOT)]) == [None]  # no growth, no question


def test_a_clients_share_holds_across_its_sessions_and_steps():
    ledger, sessions, fresh = _ledger(slots=8, share=0.25)  # the share: two fresh slots
    assert ledger.client_kv_quota == 2 * fresh
    _open(ledger, sessions, 1, ALICE)
    _open(ledger, sessions, 2, ALICE)
    with pytest.raises(KVCapacityExceeded, match="client's share"):
        ledger.check_open(3, ALICE, MIN_SLOT - 1)
    _open(ledger, sessions, 3, BOB)  # another client still gets in
    _open(ledger, sessions, 4)  # as does a session without a client
    [refused] = ledger.step_refusals([(1, sessions[1], MIN_SLOT + 1)])
    assert "client's share" in str(refused) and "cannot grow further" not in str(refused)
    assert ledger.client_kv_bytes(ALICE) == 2 * fresh and ledger.client_kv_bytes(0) == 0


def test_a_session_that_leaves_gives_its_bytes_back():
    ledger, sessions, fresh = _ledger(slots=8, share=0.25)
    _open(ledger, sessions, 1, ALICE)
    _open(ledger, sessions, 2, ALICE)
    del sessions[2]  # however it ended: the target no longer holds it
    ledger.slots.free(2)
    assert ledger.client_kv_bytes(ALICE) == fresh and ledger.kv_bytes == fresh
    _open(ledger, sessions, 3, ALICE)


@pytest.mark.parametrize("share", [-0.1, 1.5, math.nan])
def test_a_share_outside_0_1_is_refused(share):
    with pytest.raises(ValueError, match="per-client KV share"):
        _ledger(slots=8, share=share)


def test_the_capacity_must_be_positive_and_defaults_to_the_devices():
    for slots in (0, -1):
        with pytest.raises(ValueError, match="KV capacity"):
            _ledger(slots)
    store = KVSlots(1, 1, 1, torch.float32, torch.device("cpu"))
    assert KVLedger(store, {}, None).kv_capacity > 0
