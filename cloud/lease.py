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
from collections.abc import Awaitable
from typing import TypeVar

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient

from specsplit.cloud.triton_client import (
    MODEL_NAME,
    SessionLost,
    TritonRequestError,
    TritonSession,
    VerifyReply,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
CALL_WAIT_S = 30.0  # a call in flight when the client left: time it gets to finish
END_TIMEOUT_S = 5.0
# A START cut off in transit may reach Triton after our END (refused as unknown): ask again.
END_RETRY_S = (0.0, 0.5, 2.0)


class Lease:
    """TritonSession's calls, each shielded from the caller's cancellation; ``release`` always
    frees what START allocated."""

    def __init__(self, client: aioclient.InferenceServerClient, triton: TritonSession):
        self.client = client
        self.triton = triton
        self.opened = False  # a START was (or may have been) sent
        self._call_task: asyncio.Future | None = None  # the latest call to Triton

    async def start(self, prompt, sampling, mode, seed: int, speculative: bool = True) -> None:
        await self._call(self.triton.start(prompt, sampling, mode, seed, speculative), opens=True)

    async def reopen(self, prompt, sampling, mode, seed: int) -> None:
        await self._call(self.triton.reopen(prompt, sampling, mode, seed), opens=True)

    async def verify(self, base_len: int, tokens, q=None) -> VerifyReply:
        return await self._call(self.triton.verify(base_len, tokens, q))

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
        await self.triton.close()
        if self.opened and broken:
            await end_sequence(self.client, sequence_id)


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
