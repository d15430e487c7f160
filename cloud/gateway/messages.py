"""Reading a stream's client messages, written once for every session mode.

A client's mistake always ends as a status code with a message (docs/design.md#errors): an
undecodable payload is INVALID_ARGUMENT (grpc would report a deserializer's exception as UNKNOWN), a
silent stream DEADLINE_EXCEEDED, a message out of place FAILED_PRECONDITION, an Echo that answers
no Probe INVALID_ARGUMENT.

``Echoes`` stands between the stream and every reader of it: it takes the client's Echo
(Start.probe, docs/design.md#probe) out of the messages, wherever it arrives, and times it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
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


_ECHOED = object()  # what the read during prefill returns when its message was the Echo


def _is_echo(msg: object) -> bool:
    return isinstance(msg, pb.ClientMessage) and msg.WhichOneof("msg") == "echo"


def _announces_draft(msg: object) -> bool:
    """A Start whose client writes a Draft next, before Started (Start.first_draft)."""
    return isinstance(msg, pb.ClientMessage) and msg.start.first_draft


class Echoes:
    """A stream's client messages with its Echo taken out, and the round trip that Echo measured.

    After ``probe_sent`` (the Probe is out) one read runs on its own, while the target
    prefills, so that the Echo is timed when it arrives; whatever that read got that is not the
    Echo goes to the next reader first. An Echo is skipped wherever it comes (a late one, in
    the read a handover passes on, cloud.gateway.handover); one without a Probe, or a second,
    is INVALID_ARGUMENT. Times are ``time.perf_counter()`` seconds.
    """

    def __init__(self, messages: AsyncIterator):
        self.messages = messages
        self.sent_at: float | None = None  # the Probe went out
        self.echo_at: float | None = None  # its Echo was read
        self.echoed = asyncio.Event()
        self._pending: asyncio.Future | None = None  # the read started at the Probe
        # Start.first_draft: a Draft follows Start before Started, and none was read yet
        self.draft_due = False

    def __aiter__(self) -> Echoes:
        return self

    def probe_sent(self) -> None:
        assert self.sent_at is None, "one Probe per stream"
        self.sent_at = time.perf_counter()
        self._pending = asyncio.ensure_future(self._read_echo())

    def rtt_s(self, now: float) -> float | None:
        """The round trip the Probe measured: exact once its Echo came, else a lower bound
        (the Probe's age at ``now``); None when no Probe was sent."""
        if self.sent_at is None:
            return None
        return (self.echo_at if self.echo_at is not None else now) - self.sent_at

    async def __anext__(self):
        while True:
            if self._pending is not None:
                pending, self._pending = self._pending, None
                msg = await pending
                if msg is _ECHOED:
                    continue
            else:
                msg = await anext(self.messages, None)
            if msg is None:
                raise StopAsyncIteration
            if not _is_echo(msg):
                # due after a Start that announced it; whatever else came, that write is done
                self.draft_due = _announces_draft(msg)
                return msg
            self._echo()

    async def _read_echo(self):
        msg = await anext(self.messages, None)
        if not _is_echo(msg):
            return msg  # not the Echo (yet): handed to the next reader
        self._echo()
        return _ECHOED

    def _echo(self) -> None:
        if self.sent_at is None:
            raise ProtocolError(
                Code.INVALID_ARGUMENT,
                "an Echo answers a Probe, and this stream was sent none (Start.probe asks for "
                "one, in a lock-step session that follows the lead)",
            )
        if self.echo_at is not None:
            raise ProtocolError(Code.INVALID_ARGUMENT, "a second Echo: a Probe is answered once")
        self.echo_at = time.perf_counter()
        self.echoed.set()

    async def settle(self, wait_s: float = 1.0) -> None:
        """Before the stream ends with a status: waits (at most ``wait_s``) for the read the
        Probe started, so that the client's Echo, written as it read the Probe, is received,
        and likewise for the Draft a Start with first_draft announced (before_refusing says why
        a write in flight costs the client our status)."""
        if self.draft_due and self._pending is None:
            self._pending = asyncio.ensure_future(anext(self.messages, None))
        if self._pending is not None and not self._pending.done():
            with contextlib.suppress(Exception):
                await asyncio.wait({self._pending}, timeout=wait_s)

    def close(self) -> None:
        """The stream is done with: the read the Probe started, if no one took it, stops."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.cancel()
            if pending.done() and not pending.cancelled():
                pending.exception()  # retrieved: a read that failed is no news any more


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
    """Receives a stream's first message, and the Draft its Start announced (Start.first_draft),
    before it is refused, waiting at most ``wait_s`` in all.

    A grpc.aio client whose write is still in flight when the stream ends reports INTERNAL
    ("Internal error from Core", grpc/grpc#36066) instead of the status we send; the edge writes
    its Start (and, cloud-led, its first block) and then only reads until Started, so once those
    are received our status is the one it sees.
    """
    if not hasattr(requests, "__aiter__"):
        return
    messages = requests.__aiter__()
    # A timeout or a broken stream: refuse all the same.
    with contextlib.suppress(Exception):
        async with asyncio.timeout(wait_s):
            if _announces_draft(await anext(messages, None)):
                await anext(messages, None)


# A stream refused without reading any of its messages (a wrong token, a client past its held
# streams) ends this long after it came: a client's write completes on its own side once its
# transport takes the message, so the wait lets its Start (and half-close) go first. Without
# it, the metrics test's client (its Start written by grpc.aio from a request iterator) saw
# INTERNAL instead of UNAUTHENTICATED once in about a dozen CI runs.
REFUSE_UNREAD_AFTER_S = 0.1


async def before_refusing_unread() -> None:
    """``before_refusing`` for a stream whose messages must stay unread: a short wait instead
    (REFUSE_UNREAD_AFTER_S). A write the client starts later and still has in flight when the
    stream ends can meet grpc's bug all the same."""
    await asyncio.sleep(REFUSE_UNREAD_AFTER_S)


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
