"""Reading a stream's client messages, written once for every session mode.

A client's mistake always ends as a status code with a message (docs/design.md#errors): an
undecodable payload is INVALID_ARGUMENT (grpc would report a deserializer's exception as UNKNOWN), a
silent stream DEADLINE_EXCEEDED, a message out of place FAILED_PRECONDITION.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from google.protobuf.message import DecodeError

from specsplit.cloud.gateway.session import Code, ProtocolError
from specsplit.shared.protocol import pb


class Undecodable:
    """Stands in the request stream for a payload that is not a ClientMessage."""

    def __init__(self, error: str):
        self.error = error


def decode_client_message(data: bytes) -> pb.ClientMessage | Undecodable:
    """The request deserializer: never raises, so a bad payload reaches the servicer."""
    try:
        return pb.ClientMessage.FromString(data)
    except DecodeError as e:
        return Undecodable(str(e))


async def next_message(
    messages: AsyncIterator, timeout_s: float | None, waiting_for: str
) -> pb.ClientMessage | None:
    """The client's next message, None at a half-close. Raises ProtocolError when none comes
    within ``timeout_s`` (DEADLINE_EXCEEDED) or it cannot be decoded (INVALID_ARGUMENT)."""
    try:
        msg = await asyncio.wait_for(anext(messages, None), timeout_s)
    except asyncio.TimeoutError:
        raise ProtocolError(
            Code.DEADLINE_EXCEEDED, f"no {waiting_for} within {timeout_s:g} s"
        ) from None
    if isinstance(msg, Undecodable):
        raise ProtocolError(Code.INVALID_ARGUMENT, f"undecodable ClientMessage: {msg.error}")
    return msg


async def next_draft(
    messages: AsyncIterator, timeout_s: float | None
) -> pb.Draft | pb.Finish | None:
    """What a client may send after Start: a Draft, a Finish (stop now), or None at a
    half-close (it only listens from now on). Anything else is FAILED_PRECONDITION."""
    msg = await next_message(messages, timeout_s, "Draft or Finish")
    if msg is None:
        return None
    kind = msg.WhichOneof("msg")
    if kind not in ("draft", "finish"):
        raise ProtocolError(Code.FAILED_PRECONDITION, f"unexpected {kind} after Start")
    return getattr(msg, kind)


async def before_refusing(requests, wait_s: float = 1.0) -> None:
    """Receives a stream's first message (waiting at most ``wait_s``) before it is refused.

    A grpc.aio client whose write is still in flight when the stream ends reports INTERNAL
    ("Internal error from Core") instead of the status we send; the edge writes its Start and
    then only reads, so once that Start is received our status is the one it sees.
    """
    if hasattr(requests, "__aiter__"):
        # A timeout or a broken stream: refuse all the same.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(anext(requests.__aiter__(), None), wait_s)


async def until_half_close(requests, grace_s: float, reader: asyncio.Task | None = None) -> None:
    """Reads (and drops) the client's messages until it half-closes, at most ``grace_s``; or,
    where a ``reader`` task already reads them (cloud-led), waits for it to end, then cancels it.

    A cloud-led edge drafts while the cloud streams, so a Draft can be on its way when the
    final Verdict leaves. Ending the call under it would fail that write on the client, and
    grpc.aio then marks the whole call INTERNAL: the Verdict and Finished it had not read yet
    are lost. Waiting for the half-close (the edge sends it on reading Finished) keeps the call
    open for those late Drafts. The session's slot and KV cache are already freed by then.
    """
    try:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(grace_s):
                if reader is not None:
                    await reader  # cancelled with us at the timeout
                else:
                    while await anext(requests, None) is not None:
                        pass
    finally:
        if reader is not None:
            reader.cancel()
