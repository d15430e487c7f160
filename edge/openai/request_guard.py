"""What one HTTP client may cost the OpenAI endpoint (``edge.openai.app.create_app``), checked
before a request body is parsed: its size, and how many generation requests are in progress at once.

Without a size limit FastAPI reads any body whole into memory before validating it (and a
chat's text is tokenised whole): a few multi-gigabyte bodies take the host down. Without a cap
on requests in progress, every request beyond the pool's slots waits for one, holding its
connection, its parsed body and its prompt, however many arrive. So a body over
``max_body_bytes`` is refused with 413 (by its Content-Length, or as soon as a chunked body
passes the limit), and a generation request that finds ``max_requests`` in progress (the slots
and the queue for them) with 429 and ``Retry-After``, before its body is read. Plain ASGI, so a
streamed response counts until its last event is sent.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the web stack is imported where it is used: the CLI reads the defaults
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from specsplit.edge.openai.schema import APIError

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 << 20  # a max_context prompt, as text or token ids, fits many times
MAX_WAITING = 64  # generation requests waiting for a pool slot, beyond those generating
GENERATE_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
RETRY_AFTER_S = 1


class RequestGuard:
    """ASGI middleware: the body size limit for every request, the cap on generation requests
    in progress for POSTs to ``GENERATE_PATHS``."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, max_requests: int):
        if max_body_bytes < 1 or max_requests < 1:
            raise ValueError("the body limit and the requests in progress must be >= 1")
        self.app, self.max_body_bytes, self.max_requests = app, max_body_bytes, max_requests
        self.in_progress = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or ()).get(b"content-length", b"0")
        if int(length or b"0") > self.max_body_bytes:  # h11 has checked it is a number
            await _refuse(scope, receive, send, self._too_large())
            return
        generates = scope["method"] == "POST" and scope["path"] in GENERATE_PATHS
        if generates and self.in_progress >= self.max_requests:
            from specsplit.edge.openai.schema import APIError

            busy = APIError(
                429,
                f"{self.in_progress} requests in progress, the most this endpoint takes at "
                f"once; retry in {RETRY_AFTER_S} s",
                "rate_limit_error",
                code="too_many_requests",
            )
            await _refuse(scope, receive, send, busy, {"Retry-After": str(RETRY_AFTER_S)})
            return
        self.in_progress += generates
        try:
            await self.app(scope, self._limited(receive), send)
        finally:
            self.in_progress -= generates

    def _limited(self, receive: Receive) -> Receive:
        """``receive`` that counts a body's bytes as they arrive (a chunked body has no length
        to check up front); past the limit the route's body parsing fails with 413."""
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    from starlette.exceptions import HTTPException

                    raise HTTPException(413, self._too_large().message)
            return message

        return limited

    def _too_large(self) -> APIError:
        from specsplit.edge.openai.schema import APIError

        return APIError(413, f"request body over {self.max_body_bytes} bytes", param="body")


async def _refuse(
    scope: Scope, receive: Receive, send: Send, e: APIError, headers: dict | None = None
) -> None:
    from starlette.responses import JSONResponse

    log.info("refused %s %r: %s", scope["method"], scope["path"], e.message)
    await JSONResponse(e.body(), status_code=e.status, headers=headers)(scope, receive, send)
