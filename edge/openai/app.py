"""``specsplit-edge serve``: the OpenAI API (chat and text completions, models) over the split.

Apps built on the OpenAI SDKs point their base URL at the edge and get the target's output at
split speed. Per request: messages (through the draft's chat template) or prompt -> token ids ->
a generation on a pool slot (``openai_pool``) -> text, cut at stop strings on the edge
(``openai_text``) -> OpenAI JSON, or server-sent events with ``stream: true``.

Errors are OpenAI error JSON: 400 for a bad request (FastAPI's validation errors included), the
cloud's gRPC status mapped to HTTP (UNAVAILABLE -> 503, ...). A streamed request waits for its
first tokens before answering, so errors from the cloud's Start still get their HTTP status;
an error after that arrives as an ``error`` event, as OpenAI sends it. ``/health`` answers for the
cloud (edge.openai.health): 200 while the gateway says it serves, else 503 with the reason.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from specsplit.edge.client import SERVE_ROUTES, GenerationConfig, SpecsplitError, SplitClient
from specsplit.edge.openai.health import HealthProbe
from specsplit.edge.openai.hosts import HostAllowList, HostPolicy
from specsplit.edge.openai.metrics import EdgeMetrics, speculative_decoding
from specsplit.edge.openai.pool import ClientPool, Run
from specsplit.edge.openai.request_guard import MAX_BODY_BYTES, MAX_WAITING, RequestGuard
from specsplit.edge.openai.responses import Reply, finish_reason, speculation, sse, usage
from specsplit.edge.openai.schema import (
    APIError,
    ChatRequest,
    CompletionRequest,
    RequestPlan,
    chat_plan,
    completion_plan,
)
from specsplit.edge.openai.text import TextStream
from specsplit.edge.text import TextCodec

log = logging.getLogger(__name__)


# The cloud's status -> (HTTP status, OpenAI error type, code). Others: 502, the cloud failed.
STATUS = {
    grpc.StatusCode.UNAVAILABLE: (503, "server_error", "cloud_unavailable"),
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "model_not_found"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "cloud_busy"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error", "cloud_timeout"),
}


@dataclass(frozen=True)
class ServeConfig:
    server: str  # the gateway, HOST:PORT
    draft_dir: Path  # the ONNX draft export; its tokenizer and chat template serve the text
    model_name: str  # what /v1/models lists and responses name
    route: str = "split"  # edge.client.SERVE_ROUTES
    concurrency: int = 4  # generations at once, each with its own drafter (one shared ONNX
    # Runtime session: OnnxDrafter.another); more requests wait
    generation: GenerationConfig = GenerationConfig()  # k, retry window, target model name
    threads: int | None = None  # ONNX Runtime intra-op threads (the drafters' one session)
    provider: str = "auto"  # the drafters' execution provider (edge.onnx_drafter.PROVIDERS)
    client: dict = field(default_factory=dict)  # SplitClient's TLS and token keywords
    api_key: str | None = None  # given: /v1 requests need "Authorization: Bearer <api_key>"
    allowed_hosts: tuple[str, ...] = ()  # Host names answered beyond loopback (edge.openai.hosts)
    bound_host: str | None = None  # the address or name the server listens on (also allowed)
    max_body_bytes: int = MAX_BODY_BYTES  # larger request bodies: 413 (edge.openai.request_guard)
    max_waiting: int = MAX_WAITING  # requests waiting for a slot; more at once: 429
    send_timeout_s: float = 60.0  # a stream its client does not read for this long is ended


def api_error(e: Exception) -> APIError:
    """Any failure of a request as the OpenAI error it is answered with."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, SpecsplitError):
        status, kind, code = STATUS.get(e.code, (502, "server_error", "cloud_error"))
        return APIError(status, f"cloud: {e}", kind, code=code)
    if isinstance(e, ValueError):  # the client's own checks (token ids, context length)
        return APIError(400, str(e))
    log.exception("request failed", exc_info=e)
    return APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error")


class _Stalled(Exception):
    """The client read nothing of its stream for the send timeout."""


class _EventStream(StreamingResponse):
    """Server-sent events that run ``on_close`` however the response ends: done, the client
    gone, an error, or a client that reads nothing for ``send_timeout_s`` (its unread events
    fill the sockets and the send waits): the generation and its pool slot must always be let
    go, or one such client per slot would shut the endpoint."""

    def __init__(
        self,
        events: AsyncIterator[bytes],
        on_close: Callable[[], Awaitable[None]],
        send_timeout_s: float,
    ):
        super().__init__(events, media_type="text/event-stream")
        self.headers["Cache-Control"] = "no-cache"
        self._on_close, self._send_timeout_s = on_close, send_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        async def timed(message) -> None:
            try:
                await asyncio.wait_for(send(message), self._send_timeout_s)
            except TimeoutError:
                raise _Stalled() from None

        try:
            await super().__call__(scope, receive, timed)
        except _Stalled:  # the server closes the connection: the response cannot complete
            log.warning("a client read nothing of its stream for %g s: ended", self._send_timeout_s)
        finally:
            await self._on_close()


class Endpoint:
    """The routes' work: plans in, generations on the pool, OpenAI JSON out."""

    def __init__(self, cfg: ServeConfig):
        if cfg.route not in SERVE_ROUTES:
            raise ValueError(f"route must be one of {SERVE_ROUTES}, got {cfg.route!r}")
        if cfg.max_body_bytes < 1 or cfg.max_waiting < 0 or not cfg.send_timeout_s > 0:
            raise ValueError("max_body_bytes must be >= 1, max_waiting >= 0, send_timeout_s > 0")
        self.cfg = cfg
        self.codec = TextCodec(cfg.draft_dir)
        make_drafter = None
        if cfg.route == "split":
            from specsplit.edge.onnx_drafter import OnnxDrafter

            loaded: list[OnnxDrafter] = []
            loading = threading.Lock()

            def make_drafter():  # the first slot loads the draft, the others share its session
                with loading:
                    if not loaded:
                        loaded.append(
                            OnnxDrafter(cfg.draft_dir, threads=cfg.threads, provider=cfg.provider)
                        )
                        return loaded[0]
                return loaded[0].another()

        self.pool = ClientPool(cfg.concurrency, make_drafter, address=cfg.server, **cfg.client)
        self.health = HealthProbe(cfg.server, **cfg.client)
        self.metrics = EdgeMetrics()

    async def answer(self, plan: RequestPlan, reply: Reply):
        taken = time.perf_counter()
        client = await self.pool.acquire()
        run = None
        try:
            run = Run(client, plan, self.cfg.route)
            run.taken = taken
            self.metrics.running.inc()
            first = await run.next()  # the cloud's errors at Start become HTTP statuses
        except Exception as e:
            await self._finish(run, client)
            raise api_error(e) from None
        except BaseException:  # cancelled: the client went away while we waited
            await self._finish(run, client)
            raise
        text = TextStream(self.codec.decode, plan.stops)
        if plan.stream:
            events = self._events(run, first, text, plan, reply)
            on_close = lambda: self._finish(run, client)  # noqa: E731
            return _EventStream(events, on_close, self.cfg.send_timeout_s)
        try:
            content = "".join([delta async for delta in _deltas(run, first, text)])
        except Exception as e:
            raise api_error(e) from None
        finally:
            await self._finish(run, client)
        stats, stopped = run.gen.stats, text.stopped
        self._log(plan, text, stopped, run)
        n = usage(len(plan.prompt_ids), len(text.ids))
        finish = finish_reason(stats, stopped)
        self._observe(run, plan, text, finish)
        answer = reply.complete(content, finish, n, speculation(stats, stopped))
        answer["metrics"] = {"speculative_decoding": speculative_decoding(stats)}
        return answer

    async def _events(
        self, run: Run, first: list[int] | None, text: TextStream, plan: RequestPlan, reply: Reply
    ) -> AsyncIterator[bytes]:
        if reply.chat:  # OpenAI opens a chat stream with the role
            yield sse(reply.chunk("", role=True))
        try:
            async for delta in _deltas(run, first, text):
                yield sse(reply.chunk(delta))
        except Exception as e:
            yield sse(api_error(e).body())
            return
        stats, stopped = run.gen.stats, text.stopped
        self._log(plan, text, stopped, run)
        finish = finish_reason(stats, stopped)
        self._observe(run, plan, text, finish)
        last = reply.chunk(None, finish)
        last["specsplit"] = speculation(stats, stopped)
        last["metrics"] = {"speculative_decoding": speculative_decoding(stats)}
        yield sse(last)
        if plan.include_usage:
            yield sse(reply.usage_chunk(usage(len(plan.prompt_ids), len(text.ids))))
        yield sse("[DONE]")

    def _observe(self, run: Run, plan: RequestPlan, text: TextStream, finish: str) -> None:
        now = time.perf_counter()
        generated = len(text.ids)
        self.metrics.observe(
            run.gen.stats, len(plan.prompt_ids), generated, finish, run.began - run.taken,
            now - run.taken,
        )  # fmt: skip

    async def _finish(self, run: Run | None, client: SplitClient) -> None:
        try:
            if run is not None:
                await run.close()
        finally:
            if run is not None:
                self.metrics.running.dec()
            self.pool.release(client)

    def _log(self, plan: RequestPlan, text: TextStream, stopped: bool, run: Run) -> None:
        s = run.gen.stats
        log.info(
            "%s: %d prompt + %d tokens, %.1f tok/s, acceptance %.2f, %.2f tokens/round, %s",
            s.route,
            len(plan.prompt_ids),
            len(text.ids),
            s.tokens_per_s,
            s.acceptance_rate,
            s.tokens_per_round,
            "stop string" if stopped else s.finish,
        )


async def _deltas(run: Run, first: list[int] | None, text: TextStream) -> AsyncIterator[str]:
    """Text deltas as chunks commit, until the generation ends or a stop string matches (which
    ends it at once: the rest would be thrown away)."""
    chunk = first
    while chunk is not None:
        if delta := text.push(chunk):
            yield delta
        if text.stopped:
            await run.close()
            return
        chunk = await run.next()
    if rest := text.flush():
        yield rest


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _validation_message(e: RequestValidationError) -> tuple[str, str | None]:
    errors = e.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    return (f"{param}: {first['msg']}" if param else first["msg"]), param


def _answer_errors_as_openai(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return _error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(e)  # OpenAI answers 400 where FastAPI says 422
        return _error_response(APIError(400, message, param=param))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        return _error_response(api_error(e))  # e.g. a drafter that failed to load

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException) -> JSONResponse:
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return _error_response(APIError(e.status_code, str(e.detail), kind))


def _require_api_key(app: FastAPI, api_key: str) -> None:
    """OpenAI's authentication: every /v1 request carries the key as a bearer token (the
    ``openai`` client's ``api_key``); compared in constant time. /health stays open."""
    expected = api_key.encode()

    @app.middleware("http")
    async def _check(request: Request, call_next):
        if request.url.path.startswith("/v1"):
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                given.strip().encode(), expected
            ):
                message = "missing or incorrect API key (send Authorization: Bearer <key>)"
                return _error_response(APIError(401, message, code="invalid_api_key"))
        return await call_next(request)


def create_app(cfg: ServeConfig) -> FastAPI:
    endpoint = Endpoint(cfg)  # loads the tokenizer now: a wrong --draft fails before binding
    created = int(time.time())
    card = {"id": cfg.model_name, "object": "model", "created": created, "owned_by": "specsplit"}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        try:
            await endpoint.pool.close()
        finally:
            await endpoint.health.close()

    app = FastAPI(title="specsplit edge", lifespan=lifespan, docs_url=None, redoc_url=None)

    _answer_errors_as_openai(app)
    # Added before the API key check, so that one runs first (the last added is outermost).
    guard = dict(max_body_bytes=cfg.max_body_bytes, max_requests=cfg.concurrency + cfg.max_waiting)
    app.add_middleware(RequestGuard, **guard)
    if cfg.api_key:
        _require_api_key(app, cfg.api_key)
    # Last added, so outermost: a rebound name gets nothing else, not even a 401 or 429.
    app.add_middleware(HostAllowList, policy=HostPolicy(cfg.allowed_hosts, cfg.bound_host))

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        if model_id != cfg.model_name:
            raise APIError(404, f"model {model_id!r} not found", code="model_not_found")
        return card

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text (edge.openai.metrics); open without the API key, as /health is."""
        body, content_type = endpoint.metrics.exposition()
        return Response(body, media_type=content_type)

    @app.get("/health")
    async def health() -> JSONResponse:
        """For load balancers (open without the API key): ok only while the cloud serves."""
        cloud = await endpoint.health.check()
        return JSONResponse(cloud.body(), status_code=200 if cloud.ok else 503)

    # Tokenising (and rendering a chat template) takes a while on a body of megabytes: in a
    # worker thread, so the event loop keeps streaming the other requests' tokens meanwhile.
    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest):
        plan = await asyncio.to_thread(chat_plan, req, endpoint.codec, cfg.generation)
        return await endpoint.answer(plan, Reply(chat=True, model=cfg.model_name))

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        plan = await asyncio.to_thread(completion_plan, req, endpoint.codec, cfg.generation)
        return await endpoint.answer(plan, Reply(chat=False, model=cfg.model_name))

    return app
