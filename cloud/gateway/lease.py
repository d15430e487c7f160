"""A Triton session's lifetime at the gateway: every START is matched by an END.

A client that cancels mid-call cancels the gateway's handler; had that cancelled the Triton call
too, the cancelled read would cancel the session's stream, the END sent on it would never arrive,
and a START cut off in transit could reach Triton after any END we sent. So a call runs in its
own task and the handler only waits for it (shielded): the call completes, and ``release`` ends
the session on its intact stream. Only a call that fails its transport (or outlives a generous
wait) leaves the END to a request of its own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient

from specsplit.cloud.gateway.replicas import Replica, ReplicaSet
from specsplit.cloud.gateway.triton_client import (
    MODEL_NAME,
    SessionLost,
    StepReply,
    TritonRequestError,
    TritonSequence,
    TritonUnavailable,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
CALL_WAIT_S = 30.0  # a call in flight when the client left: time it gets to finish
END_TIMEOUT_S = 5.0
REOPEN_PAUSE_S = 0.5
# A START cut off in transit may reach Triton after our END (refused as unknown): ask again.
END_RETRY_S = (0.0, 0.5, 2.0)


class Lease:
    """TritonSequence's calls, each shielded from the caller's cancellation, on one replica of
    ``replicas``; a session whose replica failed (or lost it) re-opens from its committed prefix
    on a replica that is up; ``release`` always frees what START allocated."""

    def __init__(self, replicas: ReplicaSet, factory: Callable[[object], TritonSequence]):
        self.replicas = replicas
        self.factory = factory
        self.replica: Replica = replicas.place()
        self.triton = factory(self.replica.client)
        self.opened = False  # a START was (or may have been) sent
        self.moves = 0  # re-opens after a lost session or a failed replica
        self._call_task: asyncio.Future | None = None  # the latest call to Triton
        self._params: tuple = ()  # what a re-open repeats: sampling, rule, seed, speculative

    @property
    def client(self) -> aioclient.InferenceServerClient:
        return self.replica.client

    @property
    def kv_bytes_per_token(self) -> int | None:
        """What one KV position costs in the replica holding the session, as its target
        reported at the last (re-)open; None when it did not say (an older model, a fake)."""
        return getattr(self.triton, "kv_bytes_per_token", None)

    async def start(
        self, prompt, sampling, verification, seed: int, speculative: bool = True
    ) -> None:
        self._params = (sampling, verification, seed, speculative)
        try:
            await self._call(self.triton.start(prompt, *self._params), opens=True)
        except TritonUnavailable:
            self.replicas.failed(self.replica)
            await self._recover(prompt, self._failover_deadline(), move=True)

    async def step(self, committed: Sequence[int], tokens, q=None) -> StepReply:
        """Verifies ``tokens`` (the last committed token, then the drafts) after ``committed``;
        re-opens once when Triton lost the session, and as often as the failover window allows
        when the replica failed. A session lost again right after its re-open raises."""
        deadline = None
        lost = False
        while True:
            try:
                return await self._call(self.triton.step(len(committed), tokens, q))
            except SessionLost:
                if lost:
                    raise
                lost = True
                log.info("session lost in Triton; re-opening at %d tokens", len(committed))
                failed = False  # the replica answered: re-open right there
            except TritonUnavailable as e:
                log.warning("replica %s failed mid-session: %s", self.replica.url, e)
                self.replicas.failed(self.replica)
                failed = True
            deadline = deadline or self._failover_deadline()
            await self._recover(committed, deadline, move=failed)

    def _failover_deadline(self) -> float:
        return time.monotonic() + self.replicas.failover_wait_s

    async def _recover(self, committed: Sequence[int], deadline: float, move: bool) -> None:
        """A fresh sequence holding ``committed``: on the same replica when only the session was
        lost, else on a replica that is up."""
        while True:
            if move:
                await self.replicas.wait_up(deadline)  # TritonUnavailable at the deadline
                self._move()
            self.moves += 1
            try:
                await self._call(self.triton.reopen(committed, *self._params[:3]), opens=True)
                return
            except TritonUnavailable as e:
                log.warning("re-open on %s failed: %s", self.replica.url, e)
                self.replicas.failed(self.replica)
                move = True
                # A replica can call its model ready and still fail every request (a dead
                # stub, until its restart): never retry it in a busy loop.
                await asyncio.sleep(min(REOPEN_PAUSE_S, max(0.0, deadline - time.monotonic())))

    def _move(self) -> None:
        old, old_triton = self.replica, self.triton
        self.replicas.leave(old)
        self.replica = self.replicas.place()
        self.triton = self.factory(self.replica.client)
        self.triton.speculative = old_triton.speculative
        if self.replica is not old:
            log.warning("session moved from replica %s to %s", old.url, self.replica.url)
        _background(old_triton.close())  # a dead replica's stream: best effort, never raises

    async def _call(self, coro: Awaitable[T], opens: bool = False) -> T:
        if opens:
            self.opened = True  # before sending: a cancel mid-START must still END it
        self._call_task = asyncio.ensure_future(coro)
        return await asyncio.shield(self._call_task)

    async def release(self) -> None:
        """Never raises. Lets a call in flight finish, then ENDs the session on its stream; a
        request of its own when that stream is broken."""
        task = self._call_task
        if task is not None and not task.done():
            await asyncio.wait([task], timeout=CALL_WAIT_S)
        broken = False
        if task is not None:
            if not task.done():
                task.cancel()
                broken = True
            elif task.cancelled():
                broken = True
            else:
                error = task.exception()  # retrieved either way: no "never retrieved" warning
                broken = error is not None and not isinstance(
                    error, SessionLost | TritonRequestError
                )
        sequence_id = self.triton.sequence_id
        try:
            await self.triton.close()
            if self.opened and broken:
                await end_sequence(self.client, sequence_id)
        finally:
            self.replicas.leave(self.replica)


_pending: set[asyncio.Task] = set()


def _background(coro: Awaitable) -> None:
    task = asyncio.ensure_future(coro)
    _pending.add(task)  # held until done: the loop keeps only weak references to tasks
    task.add_done_callback(_pending.discard)


async def end_sequence(client: aioclient.InferenceServerClient, sequence_id: int) -> bool:
    """Frees one sequence's KV cache with a unary END; True when Triton freed it."""
    empty = grpcclient.InferInput("TOKENS", [1, 0], "INT64")
    empty.set_data_from_numpy(np.zeros((1, 0), dtype=np.int64))
    for pause in END_RETRY_S:
        await asyncio.sleep(pause)
        try:
            await client.infer(
                MODEL_NAME,
                [empty],
                sequence_id=sequence_id,
                sequence_end=True,
                client_timeout=END_TIMEOUT_S,
            )
            return True
        except Exception as e:  # unknown sequence, Triton down: nothing more to do than retry
            unknown = "START flag" in str(e) or "SESSION_NOT_FOUND" in str(e)
            if not unknown:
                log.info("could not end sequence %d: %s", sequence_id, e)
                return False
    return False
