"""The public gRPC service (proto/specsplit/v1): validates, keeps sessions, forwards to Triton.

Thin servicer: protocol bookkeeping lives in ``cloud.session``, Triton I/O in
``cloud.triton_client``. Every client error is a status code with a precise message; one bad
stream never affects another.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable

import grpc
import tritonclient.grpc.aio as aioclient
from grpc_health.v1 import health, health_pb2_grpc

from specsplit.cloud.admission import Admission, Refused, Ticket, client_key
from specsplit.cloud.capacity import StepTime
from specsplit.cloud.cloud_led import cloud_led_rounds
from specsplit.cloud.health import update_health, watch_health
from specsplit.cloud.identity import ModelIdentity
from specsplit.cloud.lease import Lease
from specsplit.cloud.limits import (
    Limits,
    before_refusing,
    check_verification,
    decode_client_message,
    next_message,
    sampling_config,
    until_half_close,
)
from specsplit.cloud.lockstep import lockstep_rounds
from specsplit.cloud.metrics import GatewayMetrics
from specsplit.cloud.replicas import ReplicaSet, parse_urls
from specsplit.cloud.security import Security, bearer_token
from specsplit.cloud.session import (
    Code,
    Commit,
    Finish,
    ProtocolError,
    Session,
    check_ids,
)
from specsplit.cloud.triton_client import (
    SessionLost,
    TritonRequestError,
    TritonSession,
    TritonUnavailable,
)
from specsplit.shared.acceptance import resolve_mode
from specsplit.shared.protocol import (
    MODE_TO_PB,
    PB_TO_MODE,
    PROTOCOL_VERSION,
    SERVICE_NAME,
    pb,
    pb_grpc,
    sparse_from_pb,
)

log = logging.getLogger(__name__)


_STATUS = {c: getattr(grpc.StatusCode, c.value) for c in Code}
STEPS_KEPT = 64  # target passes behind Started.step_ms


class SpeculativeService(pb_grpc.SpeculativeDecodingServicer):
    def __init__(
        self,
        replicas: ReplicaSet,
        model: ModelIdentity,
        limits: Limits | None = None,
        session_factory: Callable[[aioclient.InferenceServerClient], TritonSession] = TritonSession,
        admission: Admission | None = None,
        quota_by_token: bool = False,  # the port requires tokens: quotas count tokens, not peers
    ):
        self.replicas = replicas
        self.admission = admission or Admission()
        self.quota_by_token = quota_by_token
        self.session_factory = session_factory  # tests pass fakes
        self.model = model
        self.limits = limits or Limits()
        self.metrics = GatewayMetrics(replicas)  # observes the protocol around Generate
        self.active = 0
        self.steps = StepTime(STEPS_KEPT)  # recent target passes, as one-row steps
        self._closing: set[asyncio.Task] = set()
        self.health_task: asyncio.Task | None = None

    async def close(self) -> None:
        if self.health_task is not None:
            self.health_task.cancel()
        if self._closing:
            await asyncio.wait(self._closing, timeout=10)
        await self.replicas.close()

    def _release(self, lease: Lease, ticket: Ticket) -> None:
        # Freeing the Triton session runs in its own task: a client that cancels the call right
        # after Finished (or mid-generation) cancels this handler, and must not leak the KV cache.
        # Its KV reservation ends when Triton has freed the cache, not before.
        task = asyncio.create_task(lease.release())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        task.add_done_callback(lambda _: ticket.free())

    def _client(self, context) -> str | None:
        token = bearer_token(context.invocation_metadata()) if self.quota_by_token else None
        return client_key(token, context.peer(), self.quota_by_token)

    async def Generate(self, request_iterator, context) -> AsyncIterator[pb.ServerMessage]:
        if self.active >= self.limits.max_sessions:
            await before_refusing(request_iterator)
            wait_ms = self.admission.retry_after_ms()
            full = Refused(
                f"server at its limit of {self.limits.max_sessions} sessions; retry in "
                f"{wait_ms} ms, or on another replica",
                retry_after_ms=wait_ms,
            )
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, full.message, full.trailing_metadata()
            )
        try:
            ticket = self.admission.enter(self._client(context))
        except Refused as e:
            await before_refusing(request_iterator)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, e.message)
        self.active += 1
        triton = Lease(self.replicas, self.session_factory)
        readers: list[asyncio.Task] = []  # a cloud-led session's, still reading the stream
        try:
            async for msg in self._generate(request_iterator, triton, ticket, readers):
                yield msg
        except Refused as e:  # the Start was received: the client reads this status
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, e.message, e.trailing_metadata()
            )
        except ProtocolError as e:
            await context.abort(_STATUS[e.code], e.message)
        except SessionLost as e:  # lost again right after a re-open: Triton is restarting
            log.warning("session lost twice in one round: %s", e)
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                "inference server lost the session twice in one round; "
                "retry with the committed sequence as the prompt",
            )
        except TritonUnavailable as e:
            log.warning("inference server unavailable: %s", e)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "inference server unavailable")
        except TritonRequestError as e:
            log.error("inference server refused a validated request: %s", e)
            await context.abort(grpc.StatusCode.INTERNAL, f"inference server error: {e}")
        finally:
            self.active -= 1
            ticket.leave()
            self._release(triton, ticket)
        await until_half_close(request_iterator, self.limits.half_close_grace_s, *readers)

    async def _generate(self, requests, triton: Lease, ticket: Ticket, readers: list):
        it = requests.__aiter__()
        first = await next_message(it, self.limits.start_timeout_s, "Start")
        if first is None:
            return
        t_start = time.perf_counter()
        if first.WhichOneof("msg") != "start":
            raise ProtocolError(Code.FAILED_PRECONDITION, "the first message must be Start")
        if first.start.cloud_only and first.start.cloud_led:
            raise ProtocolError(
                Code.INVALID_ARGUMENT, "cloud_only and cloud_led exclude each other"
            )
        session = self._open(first.start)
        ticket.reserve(len(session.prompt) + session.max_new_tokens)
        speculative = not first.start.cloud_only
        await triton.start(
            session.prompt, session.sampling, session.mode, session.seed, speculative
        )
        started = self._started(session, first.start.cloud_led)
        started.setup_ms = (time.perf_counter() - t_start) * 1e3
        yield pb.ServerMessage(started=started)
        if first.start.cloud_only:
            rounds = self._cloud_only(session, triton, it)
        elif first.start.cloud_led:
            rounds = cloud_led_rounds(self, session, triton, it)
        else:
            rounds = lockstep_rounds(self, session, triton, it)
        async for verdict in rounds:
            yield pb.ServerMessage(verdict=verdict)
        readers += [session.reader] if session.reader else []
        finished = pb.Finished(
            committed_len=session.committed_len,
            reason=int(session.finish),
            target_forward_passes=session.rounds,
            drafts_dropped=session.drafts_dropped,
            drafts_used=session.drafts_used,
        )
        yield pb.ServerMessage(finished=finished)

    def _open(self, start: pb.Start) -> Session:
        if start.protocol_version != PROTOCOL_VERSION:
            raise ProtocolError(
                Code.FAILED_PRECONDITION,
                f"unsupported protocol_version {start.protocol_version} (this server speaks 1)",
            )
        if start.model and start.model != self.model.name:
            raise ProtocolError(
                Code.NOT_FOUND, f"unknown model {start.model!r} (serving {self.model.name!r})"
            )
        limits = self.model.limits
        prompt = list(start.prompt_ids)
        if not prompt:
            raise ProtocolError(Code.INVALID_ARGUMENT, "prompt_ids must hold at least one token")
        check_ids(prompt, limits.vocab_size, "prompt_ids")
        check_ids(start.sampling.stop_token_ids, limits.vocab_size, "stop_token_ids")
        if len(prompt) >= limits.max_context:
            raise ProtocolError(
                Code.INVALID_ARGUMENT,
                f"prompt of {len(prompt)} tokens leaves no room in "
                f"max_context {limits.max_context}",
            )
        if start.sampling.max_new_tokens < 1:
            raise ProtocolError(Code.INVALID_ARGUMENT, "max_new_tokens must be >= 1")
        check_verification(start.verification)
        sampling = sampling_config(start.sampling, limits.vocab_size)
        try:
            requested = PB_TO_MODE.get(start.verification)
            mode = resolve_mode(requested, sampling.temperature, has_q=True)
        except ValueError as e:
            raise ProtocolError(Code.INVALID_ARGUMENT, str(e)) from None
        return Session(
            limits=limits,
            prompt=prompt,
            sampling=sampling,
            mode=mode,
            # Absent: a fresh random seed per request, returned in Started.
            seed=start.sampling.seed if start.sampling.HasField("seed") else secrets.randbits(63),
            max_new_tokens=min(start.sampling.max_new_tokens, limits.max_context - len(prompt)),
            stop_ids=frozenset(start.sampling.stop_token_ids),
        )

    def _started(self, session: Session, cloud_led: bool) -> pb.Started:
        lim = self.model.limits
        return pb.Started(
            session_id=uuid.uuid4().hex,
            model=self.model.to_pb(),
            limits=pb.Limits(
                max_draft_tokens=lim.max_draft_tokens,
                max_context=lim.max_context,
                max_q_entries=lim.max_q_entries,
            ),
            protocol_version=PROTOCOL_VERSION,
            verification=MODE_TO_PB[session.mode],
            committed_len=session.committed_len,
            max_new_tokens=session.max_new_tokens,
            seed=session.seed,
            q_counts=True,
            cloud_led=cloud_led,
            accepts_lead=True,
            step_ms=self.steps.ms,
        )

    async def _cloud_only(self, session: Session, triton: Lease, it):
        # Watch the client stream for Finish while the target generates alone.
        # A plain half-close is fine; only an explicit Finish cancels; a Draft is refused.
        # The watcher only raises a flag: a round in flight commits (and may set a stop reason),
        # and the Finish takes effect before the next round, so neither overwrites the other.
        refused: list[ProtocolError] = []
        stop = asyncio.Event()

        async def watch() -> None:
            try:  # the client may stay silent for the whole generation: no idle timeout here
                msg = await next_message(it, None, "Finish")
            except ProtocolError as e:
                refused.append(e)
                msg = None
            if msg is not None and msg.WhichOneof("msg") != "finish":
                kind = msg.WhichOneof("msg")
                refused.append(
                    ProtocolError(Code.FAILED_PRECONDITION, f"{kind} on a cloud_only stream")
                )
            if msg is not None or refused:
                stop.set()

        watcher = asyncio.create_task(watch())
        try:
            while session.finish is Finish.NONE:
                if stop.is_set():
                    session.finish = Finish.CANCELLED
                    break
                yield await self._round(session, triton, [], None, time.perf_counter())
            if refused:
                raise refused[0]
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await watcher

    def _parse_q(self, draft: pb.Draft):
        lim = self.model.limits
        qs = []
        for i, (d, msg) in enumerate(zip(draft.tokens, draft.q, strict=True)):
            if len(msg.token_ids) > lim.max_q_entries:
                raise ProtocolError(
                    Code.INVALID_ARGUMENT,
                    f"q[{i}] has {len(msg.token_ids)} entries, "
                    f"over max_q_entries {lim.max_q_entries}",
                )
            try:
                q = sparse_from_pb(msg, lim.vocab_size)
            except ValueError as e:
                raise ProtocolError(Code.INVALID_ARGUMENT, f"q[{i}]: {e}") from None
            if q.prob_of(d) <= 0:
                raise ProtocolError(
                    Code.INVALID_ARGUMENT, f"draft token {d} at {i} is outside q[{i}]'s support"
                )
            qs.append(q)
        return qs

    async def _round(self, session, triton: Lease, drafts, q, t0) -> pb.Verdict:
        tokens = [session.committed[-1], *drafts]
        # A lost session or a failed replica re-opens from the committed prefix in there.
        reply = await triton.verify(session.committed, tokens, q)
        commit: Commit = session.commit(drafts, reply.accepted, reply.token)
        self.steps.observe(len(tokens), reply.batch_rows, reply.verify_ms)
        return pb.Verdict(
            accepted=commit.accepted,
            token=commit.token or 0,
            has_token=commit.token is not None,
            committed_len=commit.committed_len,
            finished=commit.finish is not Finish.NONE,
            reason=int(commit.finish),
            timings=pb.Timings(
                verify_ms=reply.verify_ms,
                server_ms=(time.perf_counter() - t0) * 1e3,
                queue_ms=max(0.0, reply.roundtrip_ms - reply.verify_ms),
                batch_sessions=reply.batch_sessions,
                batch_rows=reply.batch_rows,
            ),
            max_draft_tokens_hint=min(reply.block_hint, self.model.limits.max_draft_tokens),
        )


async def start_gateway(
    triton_url: str | list[str],
    model: ModelIdentity,
    host: str = "127.0.0.1",
    port: int = 0,
    limits: Limits | None = None,
    security: Security | None = None,
    session_factory: Callable[[aioclient.InferenceServerClient], TritonSession] = TritonSession,
    failover_wait_s: float = 30.0,
    admission: Admission | None = None,
) -> tuple[grpc.aio.Server, int, SpeculativeService]:
    """Starts the gateway in front of one Triton or several (``host:port`` each); returns
    (server, bound port, service). Port 0 picks a free port."""
    limits, security = limits or Limits(), security or Security()
    urls = parse_urls(triton_url) if isinstance(triton_url, str) else list(triton_url)
    replicas = ReplicaSet(urls, failover_wait_s=failover_wait_s)
    service = SpeculativeService(
        replicas, model, limits, session_factory, admission, security.tokens is not None
    )
    interceptors = security.interceptors(on_refused=service.metrics.refused)
    server = grpc.aio.server(interceptors=interceptors, options=limits.server_options())
    server.add_generic_rpc_handlers((_handlers(service),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    credentials = security.credentials()
    if credentials is None:
        bound = server.add_insecure_port(f"{host}:{port}")
    else:
        bound = server.add_secure_port(f"{host}:{port}", credentials)
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    await server.start()
    await update_health(
        service.replicas, health_servicer
    )  # known before anyone is told we are ready
    service.health_task = asyncio.create_task(watch_health(service.replicas, health_servicer))
    return server, bound, service


def _handlers(service: SpeculativeService) -> grpc.GenericRpcHandler:
    # The generated add_..._to_server would decode with ClientMessage.FromString, whose
    # DecodeError grpc reports as UNKNOWN; ours hands the servicer a marker instead.
    generate = grpc.stream_stream_rpc_method_handler(
        service.metrics.instrument(service.Generate),
        request_deserializer=decode_client_message,
        response_serializer=pb.ServerMessage.SerializeToString,
    )
    return grpc.method_handlers_generic_handler(SERVICE_NAME, {"Generate": generate})
