"""Which ``Host`` headers the OpenAI endpoint (edge.openai.app) answers: a defence against DNS
rebinding, the class of bug behind Ollama's CVE-2024-28224.

A web page on ``evil.example`` can make its name resolve to 127.0.0.1 and then have the user's
browser send requests to the edge's port: to the browser that is still ``evil.example`` (same
origin, so the page reads the answers), and every request carries ``Host: evil.example``. The
endpoint spends the user's gateway token, so it answers only a Host that no rebinding produces:
an IP address (a browser sends one only for a URL that names that address), ``localhost`` and
names under ``.localhost`` (browsers resolve them to loopback themselves), this machine's own
host name, the name the endpoint was bound to, and the names given with ``--allowed-host``
(``*`` turns the check off, for a reverse proxy that checks Host itself). Any other is answered
403 before anything else runs. A request without a Host header (HTTP/1.0; no browser sends one)
passes. The API key (``--api-key``) is the defence for addresses others can reach.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the web stack is imported where it is used: the CLI reads this module
    from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger(__name__)

ANY = "*"


def host_name(header: str) -> str:
    """The name or address of a Host header: no port, no IPv6 brackets, lower case, no final
    dot."""
    header = header.strip().lower()
    if header.startswith("["):  # [::1]:8000
        return header[1 : header.find("]")] if "]" in header else header
    if header.count(":") == 1:
        header = header.partition(":")[0]
    return header.rstrip(".")


def is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class HostPolicy:
    """The names a Host header may carry, beyond IP addresses and ``localhost``."""

    def __init__(self, allowed: Iterable[str] = (), bound: str | None = None):
        names = {host_name(n) for n in allowed if n.strip()}
        if bound and not is_ip(host_name(bound)):
            names.add(host_name(bound))
        names.add(socket.gethostname().lower())
        self.names = frozenset(names)
        self.any = ANY in self.names

    def allows(self, header: str | None) -> bool:
        if self.any or not header:
            return True
        name = host_name(header)
        return (
            is_ip(name) or name == "localhost" or name.endswith(".localhost") or name in self.names
        )


class HostAllowList:
    """ASGI middleware: requests whose Host ``policy`` refuses are answered 403."""

    def __init__(self, app: ASGIApp, policy: HostPolicy):
        self.app, self.policy = app, policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan (the endpoint has no websockets)
            await self.app(scope, receive, send)
            return
        header = dict(scope.get("headers") or ()).get(b"host", b"").decode("latin-1")
        if self.policy.allows(header):
            await self.app(scope, receive, send)
            return
        from starlette.responses import JSONResponse

        from specsplit.edge.openai.schema import APIError

        log.warning(
            "refused a request for Host %r to %r: not an allowed host", header, scope["path"]
        )
        e = APIError(
            403,
            f"Host {header!r} is not allowed: this endpoint answers localhost, IP addresses and "
            "the names given with --allowed-host (a defence against DNS rebinding)",
            "permission_error",
            code="host_not_allowed",
        )
        await JSONResponse(e.body(), status_code=e.status)(scope, receive, send)
