"""The target's KV memory ledger: how many bytes of KV slots it may hold, each client's share of
them, and the refusals past either. Knows nothing of passes, prompts or verification (that is
``cloud.engine.target``'s); it counts the slots and sessions it is given.

Memory: the target holds at most ``kv_capacity`` bytes of KV slots (by default what its device
has free once the weights are loaded: ``device_kv_capacity``), and reports it with
every Open (``model.py``: KV_CAPACITY, KV_HELD), so gateways admit against what it can keep. An
Open or a step whose slot would grow past it is refused with KVCapacityExceeded (retryable: the
gateway answers RESOURCE_EXHAUSTED with a retry hint), the pass served without it; so is the
session behind an out-of-memory error in a pass, which is then run again without it
(``cloud.engine.target``). One client
(``Open.client``, the gateway's client hashed; 0: none) may hold at most ``kv_per_client_share``
of the capacity over all its sessions, whichever gateways opened them (``client_kv_quota``): an
Open or a step past it is refused the same way, other clients' unaffected; sessions without a
client count against the whole capacity alone. A session's bytes are its client's until it ends
(END, an eviction, a lapsed lease: ``client_kv_bytes`` counts the sessions held).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from specsplit.cloud.engine.kv_slots import KVSlots, Slot
from specsplit.cloud.kv_growth import KV_PER_CLIENT_SHARE, default_budget_bytes

log = logging.getLogger(__name__)

MIB = 2**20


class KVCapacityExceeded(MemoryError):
    """The target cannot hold this session's KV now (its capacity, or its device's memory in a
    pass): the session is left as it was (an Open: not opened), the others are served."""


class Held(Protocol):
    """A session as the ledger counts it: its slot, and whose share it counts against."""

    slot: Slot
    client: int  # 0: none


def device_kv_capacity(device: torch.device) -> int:
    """Bytes of KV slots a target may hold by default: nine tenths of what its GPU has free
    once the weights are loaded, or ``cloud.kv_growth.default_budget_bytes`` on CPU (half the
    host's available memory)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.9)
    return default_budget_bytes()


def check_per_client_share(share: float) -> None:
    if not 0 <= share <= 1:  # also refuses NaN
        raise ValueError(f"the per-client KV share must be in [0, 1] (0: off), not {share}")


class KVLedger:
    """The KV bytes of ``slots`` against ``kv_capacity``, and of ``sessions`` (the target's live
    ones, read at every question) against each client's share. Counted from what is held, so a
    session that ends in any way gives its bytes back without bookkeeping of its own."""

    def __init__(
        self,
        slots: KVSlots,
        sessions: Mapping[int, Held],
        kv_capacity: int | None = None,  # bytes; None: its device's (device_kv_capacity)
        kv_per_client_share: float = KV_PER_CLIENT_SHARE,  # of kv_capacity, per client; 0: off
    ):
        check_per_client_share(kv_per_client_share)
        if kv_capacity is not None and kv_capacity < 1:
            raise ValueError("the KV capacity must be > 0 bytes")
        self.slots, self.sessions = slots, sessions
        self.kv_per_client_share = kv_per_client_share
        self.kv_capacity = kv_capacity or device_kv_capacity(slots.device)
        quota = self.client_kv_quota
        per_client = f"{quota / MIB:.0f} MiB" if quota is not None else "no quota"
        log.info("KV capacity %.0f MiB, per client %s", self.kv_capacity / MIB, per_client)

    @property
    def kv_bytes(self) -> int:
        """Bytes of KV slots held now, every session's (and any scratch slot)."""
        return self.slots.bytes_held

    @property
    def client_kv_quota(self) -> int | None:
        """Bytes of KV slots one client's sessions may hold together: ``kv_per_client_share``
        of the capacity; None: no quota."""
        if not self.kv_per_client_share:
            return None
        return max(1, int(self.kv_capacity * self.kv_per_client_share))

    def client_kv_bytes(self, client: int) -> int:
        """Bytes of KV slots the sessions of ``client`` hold now (0: none counted)."""
        return self._bytes_by_client().get(client, 0) if client else 0

    def check_open(self, sid: int, client: int, positions: int) -> int:
        """The bytes a fresh slot of ``positions`` takes for session ``sid`` of ``client``;
        KVCapacityExceeded where they would pass the capacity, or the client's share (call it
        once the session's old slot, if any, is freed)."""
        need = self.slots.growth_bytes(None, positions)
        if self.kv_bytes + need > self.kv_capacity:
            raise self.full(sid, need, "its prompt")
        quota = self.client_kv_quota
        if client and quota is not None:
            held = self.client_kv_bytes(client)
            if held + need > quota:
                raise self._client_full(sid, need, "its prompt", held, quota, need)
        return need

    def step_refusals(
        self, steps: Sequence[tuple[int, Held, int]]
    ) -> list[KVCapacityExceeded | None]:
        """Per step of one pass, (sid, its session, the positions its slot must hold), in
        order: None where its slot may grow (then counted against the steps after it), else its
        refusal past the capacity or its client's share (the session to be left as it was)."""
        held, bpt = self.kv_bytes, self.slots.bytes_per_token
        quota, by_client = self.client_kv_quota, None
        out: list[KVCapacityExceeded | None] = []
        for sid, session, positions in steps:
            grow = self.slots.growth_bytes(session.slot, positions)
            if held + grow > self.kv_capacity:
                out.append(self.full(sid, grow, "its next step"))
                continue
            client = session.client
            if grow and client and quota is not None:
                by_client = by_client if by_client is not None else self._bytes_by_client()
                mine = by_client.get(client, 0)
                if mine + grow > quota:
                    whole = session.slot.capacity * bpt + grow
                    out.append(self._client_full(sid, grow, "its next step", mine, quota, whole))
                    continue
                by_client[client] = mine + grow
            held += grow
            out.append(None)
        return out

    def full(self, sid: int, need: int, what: str) -> KVCapacityExceeded:
        """The refusal of ``need`` more bytes for session ``sid`` (``what`` needs them) past
        the capacity, or past what its device could allocate."""
        return KVCapacityExceeded(
            f"session {sid}: {what} needs {need / MIB:.1f} MiB more KV memory, "
            f"{max(self.kv_capacity - self.kv_bytes, 0) / MIB:.1f} of "
            f"{self.kv_capacity / MIB:.1f} MiB free here; retry when sessions end"
        )

    def _client_full(
        self, sid: int, need: int, what: str, held: int, quota: int, whole: int
    ) -> KVCapacityExceeded:
        """The refusal of ``need`` more bytes for session ``sid`` past its client's share
        (``quota``, of which its sessions hold ``held``); ``whole``: the session's slot with
        them, which alone may be more than the share (then no other session's end helps)."""
        if whole <= quota:
            then = "; retry when its sessions end"
        elif what == "its prompt":
            then = "; use a shorter prompt"
        else:
            then = "; this session cannot grow further (its slot alone would exceed the share)"
        return KVCapacityExceeded(
            f"session {sid}: {what} needs {need / MIB:.1f} MiB more KV memory, and its client's "
            f"sessions hold {held / MIB:.1f} MiB of the client's share of {quota / MIB:.1f} MiB "
            f"({self.kv_per_client_share:g} of the {self.kv_capacity / MIB:.1f} MiB here, "
            f"counted across every gateway){then}"
        )

    def _bytes_by_client(self) -> dict[int, int]:
        """Per client: the bytes its sessions' slots hold. Counted from the sessions held, so
        a session that ends in any way (END, an eviction, a lapsed lease, a failed prefill)
        gives its bytes back without bookkeeping of its own."""
        bpt, out = self.slots.bytes_per_token, {}
        for s in self.sessions.values():
            if s.client:
                out[s.client] = out.get(s.client, 0) + s.slot.capacity * bpt
        return out
