"""What one stream may cost the gateway: deadlines, message size, connection limits, and every
numeric field of Start checked against its real range before anything reaches Triton.

A client's mistake always ends as a status code with a message (DESIGN §8): an undecodable
payload is INVALID_ARGUMENT (grpc would report a deserializer's exception as UNKNOWN), a silent
stream DEADLINE_EXCEEDED, and the session it held is freed like any other.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from specsplit.cloud.session import Code, ProtocolError
from specsplit.shared.protocol import PB_TO_MODE, pb
from specsplit.shared.sampling import SamplingConfig

# Below this a float32 logit divided by the temperature can overflow to inf (NaN probabilities).
MIN_TEMPERATURE = 1e-4


@dataclass(frozen=True)
class Limits:
    max_sessions: int = 64  # streams at once, admitted or waiting for their Start
    start_timeout_s: float = 10.0  # from stream open to its Start
    idle_timeout_s: float = 60.0  # between a Verdict and the client's next message (split mode)
    max_message_bytes: int = 1 << 20  # a max_context prompt or a full Draft fits many times
    max_connection_idle_s: float = 300.0  # a connection without streams is closed after this
    max_connection_age_s: float = 3600.0  # then GOAWAY, so clients rebalance across replicas
    max_connection_age_grace_s: float = 600.0  # streams in flight get this long to finish
    half_close_grace_s: float = 2.0  # after Finished, for the client's half-close (see below)

    def __post_init__(self) -> None:
        if self.max_sessions < 1:
            raise ValueError("max_sessions must be >= 1")
        if min(self.start_timeout_s, self.idle_timeout_s) <= 0:
            raise ValueError("timeouts must be > 0")

    def server_options(self) -> list[tuple[str, int]]:
        ms = 1000
        return [
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            # Our own pings find dead clients; theirs (edge/channel.py: every 30 s) are allowed.
            ("grpc.keepalive_time_ms", 60 * ms),
            ("grpc.keepalive_timeout_ms", 20 * ms),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 10 * ms),
            ("grpc.http2.max_ping_strikes", 2),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.max_connection_idle_ms", int(self.max_connection_idle_s * ms)),
            ("grpc.max_connection_age_ms", int(self.max_connection_age_s * ms)),
            ("grpc.max_connection_age_grace_ms", int(self.max_connection_age_grace_s * ms)),
        ]


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


def sampling_config(params: pb.SamplingParams, vocab_size: int) -> SamplingConfig:
    """The session's sampling rule, every field checked against its real range.

    top_p 0 is read as 1 (proto3 default). top_k >= vocab_size keeps every token, the same
    distribution as 0 (disabled), and is read as 0, so it never overflows Triton's int32.
    """
    t, top_p = params.temperature, params.top_p
    if not math.isfinite(t) or t < 0 or 0 < t < MIN_TEMPERATURE:
        raise ProtocolError(
            Code.INVALID_ARGUMENT,
            f"temperature must be 0 (greedy) or finite and >= {MIN_TEMPERATURE:g}, got {t}",
        )
    if not math.isfinite(top_p) or not 0 <= top_p <= 1:
        raise ProtocolError(Code.INVALID_ARGUMENT, f"top_p must be in [0, 1], got {top_p}")
    top_k = params.top_k if params.top_k < vocab_size else 0
    return SamplingConfig(temperature=t, top_k=top_k, top_p=top_p if top_p > 0 else 1.0)


def check_verification(value: int) -> None:
    if value != pb.VERIFICATION_MODE_UNSPECIFIED and value not in PB_TO_MODE:
        raise ProtocolError(Code.INVALID_ARGUMENT, f"unknown verification mode {value}")
