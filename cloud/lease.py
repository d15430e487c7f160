"""A Triton session's lifetime at the gateway: every START is matched by an END.

The session's own stream to Triton cannot carry that END when the client cancels mid-call: the
cancelled read cancels the stream, and a cancel during Start leaves the session unmarked. So the
lease marks the session open *before* START is sent, notes when a call was interrupted, and then
frees the KV cache with a request of its own, independent of the broken stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
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
END_TIMEOUT_S = 5.0
# An interrupted START may still be on its way to Triton when our END arrives and is refused as
# unknown; asking again after this pause catches it.
END_RETRY_S = (0.0, 0.5)


class Lease:
    """TritonSession's calls, tracked; ``release`` always frees what START allocated."""

    def __init__(self, client: aioclient.InferenceServerClient, triton: TritonSession):
        self.client = client
        self.triton = triton
        self.opened = False  # a START was (or may have been) sent
        self.interrupted = False  # a call did not get its answer: its stream is unusable

    async def start(self, prompt, sampling, mode, seed: int) -> None:
        await self._call(self.triton.start, prompt, sampling, mode, seed, opens=True)

    async def reopen(self, prompt, sampling, mode, seed: int) -> None:
        await self._call(self.triton.reopen, prompt, sampling, mode, seed, opens=True)

    async def verify(self, base_len: int, tokens, q=None) -> VerifyReply:
        return await self._call(self.triton.verify, base_len, tokens, q)

    async def _call(self, fn: Callable[..., Awaitable[T]], *args, opens: bool = False) -> T:
        if opens:
            self.opened = True  # before sending: a cancel mid-START must still END it
        self.interrupted = True
        try:
            result = await fn(*args)
        except (SessionLost, TritonRequestError):
            self.interrupted = False  # Triton answered (with an error): the stream is fine
            raise
        self.interrupted = False
        return result

    async def release(self) -> None:
        """Never raises. END on the session's stream when intact, else a request of its own."""
        sequence_id = self.triton.sequence_id
        await self.triton.close()
        if self.opened and self.interrupted:
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
