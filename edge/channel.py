"""The edge's gRPC channel to a gateway: TLS (and mTLS) credentials, keepalive."""

from __future__ import annotations

from pathlib import Path

import grpc

# Pings keep NAT and load-balancer state alive across a long generation and find a dead link in
# seconds; the gateway accepts pings this often (cloud.gateway.stream_policy).
CHANNEL_OPTIONS = (
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),
    # A restarted gateway is found within a second or two, not after grpc's default reconnect
    # backoff (which grows to two minutes): the retry window (edge/retry.py) is what bounds it.
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    # gRPC core reads this as the least time a connection attempt gets (its MIN_CONNECT_TIMEOUT,
    # doc/connection-backoff.md), not only as a backoff. Set to 250 ms, an HTTP/2 handshake over
    # a link of RTT >= ~250 ms timed out: UNAVAILABLE, a retry, and at 1 s RTT 3 retries and a
    # first token after 3.1 s instead of 1.6 s (tests/test_slow_link.py). gRPC's default.
    ("grpc.min_reconnect_backoff_ms", 20_000),
)


def channel_credentials(
    tls_ca: str | Path | None = None,
    tls_cert: str | Path | None = None,
    tls_key: str | Path | None = None,
) -> grpc.ChannelCredentials:
    """TLS credentials: the CA that signed the server's certificate (None: the system's roots),
    and the client's own certificate and key for mTLS."""
    if (tls_cert is None) != (tls_key is None):
        raise ValueError("tls_cert and tls_key go together")

    def read(path: str | Path | None) -> bytes | None:
        return None if path is None else Path(path).read_bytes()

    return grpc.ssl_channel_credentials(read(tls_ca), read(tls_key), read(tls_cert))


def open_channel(
    address: str,
    *,
    tls: bool = False,
    tls_ca: str | Path | None = None,
    tls_cert: str | Path | None = None,
    tls_key: str | Path | None = None,
) -> grpc.aio.Channel:
    """A secure channel when ``tls`` or any tls_* file is given, else a plaintext one."""
    if tls or tls_ca or tls_cert or tls_key:
        creds = channel_credentials(tls_ca, tls_cert, tls_key)
        return grpc.aio.secure_channel(address, creds, options=CHANNEL_OPTIONS)
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
