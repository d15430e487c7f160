"""What one stream may cost the gateway: deadlines, message size, connection limits.

(How many sessions and how much KV memory at once is ``cloud.gateway.admission``'s; the checks of a
Start are ``cloud.gateway.start``'s; reading client messages is ``cloud.gateway.messages``'.)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StreamPolicy:
    start_timeout_s: float = 10.0  # from stream open to its Start
    # Between a Verdict and the client's next message (split mode), and for any message of ours
    # the client does not read (gRPC flow control holds it): a client that stalls either way.
    idle_timeout_s: float = 60.0
    max_message_bytes: int = 1 << 20  # a max_context prompt or a full Draft fits many times
    max_connection_idle_s: float = 300.0  # a connection without streams is closed after this
    max_connection_age_s: float = 3600.0  # then GOAWAY, so clients rebalance across replicas
    max_connection_age_grace_s: float = 600.0  # streams in flight get this long to finish
    half_close_grace_s: float = 2.0  # after Finished: messages.until_half_close
    # Streams one connection may hold open (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS): a client's
    # further streams wait in its own transport. By default twice the server's places
    # (Admission.max_sessions): streams past the places must still reach admission, which
    # refuses them with a retry hint (or reclaims an idle stream for them) rather than leaving
    # them to wait unseen; and gRPC channels of one process to one address share a connection,
    # so an edge's OpenAI server (or the load benchmark) multiplexes all its sessions over one.
    # Envoy opens another connection to a gateway when it reaches the cap.
    max_streams_per_connection: int = 128

    def __post_init__(self) -> None:
        if min(self.start_timeout_s, self.idle_timeout_s) <= 0:
            raise ValueError("timeouts must be > 0")
        if self.max_streams_per_connection < 1:
            raise ValueError("streams per connection must be >= 1")

    def server_options(self) -> list[tuple[str, int]]:
        ms = 1000
        return [
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_concurrent_streams", self.max_streams_per_connection),
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
