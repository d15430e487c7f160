"""The public port's security: TLS (mTLS with a client CA) and bearer tokens
(docs/design.md#security).

Tokens come from a file, one a line (blank lines and ``#`` comments ignored); a call must carry
``authorization: Bearer <token>`` metadata matching one of them, compared in constant time against
every token. A call without one is refused with UNAUTHENTICATED before its handler runs, from its
metadata alone: none of its messages is read (they stay in gRPC's flow-control window, never
decoded), so it costs no session, no Triton work and no more than that window of memory. The
refusal goes a moment after the call came (``messages.before_refusing_unread``): a grpc.aio
client whose write is still in flight as the call ends reports INTERNAL instead of our status
(grpc/grpc#36066). The gRPC health service stays open: balancers probe it without credentials.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from specsplit.cloud.gateway.messages import before_refusing_unread

OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})


@dataclass(frozen=True)
class Security:
    """What the gateway's port requires. All None: plaintext, no tokens (localhost only)."""

    tls_cert: Path | None = None  # PEM certificate chain
    tls_key: Path | None = None  # PEM private key
    tls_client_ca: Path | None = None  # PEM CA; given: clients must present a cert it signed
    tokens: tuple[bytes, ...] | None = None

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")

    def credentials(self) -> grpc.ServerCredentials | None:
        if self.tls_cert is None:
            return None
        ca = self.tls_client_ca.read_bytes() if self.tls_client_ca else None
        return grpc.ssl_server_credentials(
            [(self.tls_key.read_bytes(), self.tls_cert.read_bytes())],
            root_certificates=ca,
            require_client_auth=ca is not None,
        )

    def interceptors(self, on_refused=None) -> list[grpc.aio.ServerInterceptor]:
        """``on_refused(method)`` is called for each call refused for its token (metrics)."""
        return [] if self.tokens is None else [TokenAuth(self.tokens, on_refused)]


def load_tokens(path: str | Path) -> tuple[bytes, ...]:
    """Tokens from a file: one a line; blank lines and lines starting with # are ignored."""
    lines = Path(path).read_text().splitlines()
    tokens = tuple(t.encode() for line in lines if (t := line.strip()) and not t.startswith("#"))
    if not tokens:
        raise ValueError(f"{path}: no tokens (one a line; # starts a comment)")
    return tokens


def bearer_token(metadata: Sequence[tuple[str, str | bytes]] | None) -> bytes | None:
    for key, value in metadata or ():
        if key == "authorization":
            value = value.decode() if isinstance(value, bytes) else value
            scheme, _, token = value.strip().partition(" ")
            return token.strip().encode() if scheme.lower() == "bearer" and token else None
    return None


class TokenAuth(grpc.aio.ServerInterceptor):
    def __init__(self, tokens: Sequence[bytes], on_refused=None):
        self.tokens = tuple(tokens)
        self.on_refused = on_refused

    def authorized(self, metadata) -> bool:
        token = bearer_token(metadata)
        if token is None:
            return False
        ok = False
        for t in self.tokens:  # every token, no early exit: the time says nothing of which
            ok |= hmac.compare_digest(t, token)
        return ok

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method in OPEN_METHODS:
            return handler
        if self.authorized(details.invocation_metadata):
            return handler
        if self.on_refused is not None:
            self.on_refused(details.method)
        return _refusal(handler)


async def _refuse(request, context: grpc.aio.ServicerContext) -> None:
    await before_refusing_unread()  # the client's writes first: see the module's doc
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that only refuses."""
    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return make(
        _refuse,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


LOOPBACK = ("ipv4:127.", "ipv6:[::1]", "ipv6:[::ffff:127.")


def client_key(token: bytes | None, peer: str | None, by_token: bool) -> str | None:
    """Whom a quota counts: a digest of the bearer token when the port requires tokens, else
    the peer's address without its port (``ipv4:1.2.3.4:5678`` -> ``ipv4:1.2.3.4``); None (no
    quota) for a loopback or unix-socket peer."""
    if by_token:
        return None if token is None else "token:" + hashlib.sha256(token).hexdigest()[:16]
    if not peer or not peer.startswith(("ipv4:", "ipv6:")):
        return None
    address = peer.rsplit(":", 1)[0]
    # Loopback: this host's own clients, or a local proxy whose clients all share its address.
    return None if address.startswith(LOOPBACK) else address
