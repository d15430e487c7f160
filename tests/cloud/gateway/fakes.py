"""Fakes of what the gateway's mode loops and admission talk to: a ``Round`` (one step of a
session, cloud.gateway.round.Round), a client's message stream, and a ``StreamControl`` (how
admission ends a stream, cloud.gateway.admission.StreamControl)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import SimpleNamespace

from specsplit.cloud.gateway.session import Finish
from specsplit.shared.protocol import pb


class FakeControl:
    """A ``cloud.gateway.admission.StreamControl`` that records what it was asked: each end
    as (code, details), each reclaim as "reclaim"; ``ended`` (shared by several, in order)
    records this control's ``name`` at a reclaim."""

    def __init__(self, ended: list | None = None, name: object = None) -> None:
        self.calls: list = []
        self.ended, self.name = ended, name

    def end(self, code: object, details: str) -> None:
        self.calls.append((code, details))

    def reclaim(self) -> None:
        self.calls.append("reclaim")
        if self.ended is not None:
            self.ended.append(self.name)


@dataclass
class FakeSession:
    """What the mode loops read of a ``GatewaySession``."""

    committed: list[int]
    limits: SimpleNamespace
    finish: Finish = Finish.NONE
    drafts_dropped: int = 0
    drafts_used: int = 0

    @property
    def committed_len(self) -> int:
        return len(self.committed)


class FakeRound:
    """Accepts every draft, answers token 7 and commits what it verified; finishes after
    ``finish_after`` steps. ``check`` raises ``refuse`` when one is set (a ProtocolError)."""

    def __init__(self, finish_after: int = 10, committed=(1, 2, 3), max_draft_tokens=4) -> None:
        limits = SimpleNamespace(max_draft_tokens=max_draft_tokens)
        self.session = FakeSession(list(committed), limits)
        self.steps = SimpleNamespace(ms=0.0)  # no step measured: cloud-led never waits
        self.verified: list[list[int]] = []
        self.checked: list[tuple[int, bool]] = []  # (Draft.round, exact_base)
        self.finish_after = finish_after
        self.refuse: Exception | None = None
        self.stepping = asyncio.Event()  # set: steps go on; clear: the next step waits
        self.stepping.set()

    def check(self, draft, exact_base=True):
        self.checked.append((draft.round, exact_base))
        if self.refuse is not None:
            raise self.refuse
        return None

    async def verdict(self, tokens, q, t0):
        await self.stepping.wait()
        await asyncio.sleep(0)  # a step yields to the event loop, as a real one does
        session = self.session
        self.verified.append(list(tokens))
        session.committed += [*tokens, 7]
        if len(self.verified) >= self.finish_after:
            session.finish = Finish.LENGTH
        return pb.Verdict(
            accepted=len(tokens),
            token=7,
            has_token=True,
            committed_len=session.committed_len,
            finished=session.finish is not Finish.NONE,
        )


class FakeClient:
    """A client's message stream that a test writes to as the loop runs: ``send`` Drafts,
    Finishes or ClientMessages; ``close`` half-closes it (every later read sees the end)."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()

    def send(self, *msgs) -> None:
        for m in msgs:
            if isinstance(m, pb.Draft):
                m = pb.ClientMessage(draft=m)
            elif isinstance(m, pb.Finish):
                m = pb.ClientMessage(finish=m)
            self.queue.put_nowait(m)

    def close(self) -> None:
        self.queue.put_nowait(None)

    def __aiter__(self) -> FakeClient:
        return self

    async def __anext__(self):
        msg = await self.queue.get()
        if msg is None:
            self.queue.put_nowait(None)
            raise StopAsyncIteration
        return msg


async def until(condition, turns: int = 1000) -> None:
    """Lets the event loop run (a bounded count of turns, no clock) until ``condition()``."""
    for _ in range(turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"still not so after {turns} turns of the event loop")
