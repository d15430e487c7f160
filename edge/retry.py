"""When the edge tries again (docs/design.md#failure): after UNAVAILABLE (a gateway or Triton
restarting, a link down), and after RESOURCE_EXHAUSTED that says when to (a cloud at its session
limit or KV budget), with exponential backoff, never sooner than the cloud asked, for as long as a
window allows. The window measures one outage: committed progress since the last failure starts a
fresh one. A refusal without a hint (a client over its own quota) is not retried."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc

from specsplit.shared.protocol import RETRY_AFTER_KEY

DEFAULT_WINDOW_S = 60.0
HANDSHAKE_HINT = (
    "the server ended the connection during its handshake: a TLS mismatch? A TLS gateway "
    "needs --tls-ca (or tls=True), one with client certificates also --tls-cert and --tls-key; "
    "not retried"
)


def retry_after_s(e: grpc.aio.AioRpcError) -> float | None:
    """When a busy cloud said to try again (its ``retry-after-ms`` trailing metadata), in
    seconds; None when it said nothing (or nothing readable)."""
    for key, value in e.trailing_metadata() or ():
        if key == RETRY_AFTER_KEY:
            try:
                return max(0, int(value)) / 1e3
            except ValueError:
                return None
    return None


def refused_at_handshake(e: grpc.aio.AioRpcError) -> bool:
    """A connection that failed while being set up, at its TLS handshake (a certificate that
    does not verify) or closed by the server right away (plaintext to a TLS gateway, or no client
    certificate for an mTLS one), as opposed to nobody listening (a gateway restarting)."""
    details = e.details() or ""
    return (
        e.code() == grpc.StatusCode.UNAVAILABLE
        and details.startswith("failed to connect to all addresses")
        and any(s in details for s in ("Socket closed", "andshake", "SSL_ERROR"))
    )


@dataclass
class Backoff:
    window_s: float = DEFAULT_WINDOW_S
    first_s: float = 0.25
    max_s: float = 4.0
    _since: float | None = field(default=None, init=False)
    _pause: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        if self.window_s < 0:
            raise ValueError("the retry window must be >= 0 seconds")
        self._pause = self.first_s

    def progress(self) -> None:
        """Tokens were committed: the outage (if any) is over."""
        self._since, self._pause = None, self.first_s

    def next_pause(self, at_least: float = 0.0) -> float | None:
        """Seconds to wait before the next try, ``at_least`` (the server's hint); None once the
        window is spent."""
        now = time.monotonic()
        if self._since is None:
            self._since = now
        pause = max(self._pause, at_least)
        if now + pause - self._since > self.window_s:
            return None
        self._pause = min(2 * self._pause, self.max_s)
        return pause
