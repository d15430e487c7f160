"""The public gRPC service (proto/specsplit/v1): admits a stream, opens its session, runs the
session mode's loop, ends it.

Thin servicer: admission is ``cloud.gateway.admission``'s, every Start check
``cloud.gateway.start``'s, one step ``cloud.gateway.round``'s, each mode's loop its own module
(``cloud.gateway.lockstep``, ``cloud.gateway.cloud_led``, ``cloud.gateway.cloud_only``), Triton I/O
``cloud.gateway.lease``'s. Every client error is a status code with a precise message; one bad
stream never affects another.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TypeVar

import grpc
import tritonclient.grpc.aio as aioclient
from grpc_health.v1 import health, health_pb2_grpc

from specsplit.cloud.capacity import StepTime
from specsplit.cloud.gateway.admission import (
    RECLAIM_WAIT_S,
    TARGET_KV,
    Admission,
    Reclaimed,
    Reclaiming,
    Refused,
    Ticket,
)
from specsplit.cloud.gateway.cloud_led import ReadingTail, cloud_led_rounds
from specsplit.cloud.gateway.cloud_only import cloud_only_rounds
from specsplit.cloud.gateway.handover import Handover
from specsplit.cloud.gateway.health import update_health, watch_health
from specsplit.cloud.gateway.identity import ModelIdentity
from specsplit.cloud.gateway.lease import Lease
from specsplit.cloud.gateway.lockstep import lead_after_ms, lockstep_rounds
from specsplit.cloud.gateway.messages import (
    Echoes,
    before_refusing,
    before_refusing_unread,
    decode_client_message,
    next_message,
    until_half_close,
)
from specsplit.cloud.gateway.metrics import GatewayMetrics
from specsplit.cloud.gateway.replicas import ReplicaSet, parse_urls
from specsplit.cloud.gateway.retry_gate import RETRY_EARLY, RetryGate
from specsplit.cloud.gateway.round import Round
from specsplit.cloud.gateway.security import Security, bearer_token, client_key
from specsplit.cloud.gateway.session import Code, GatewaySession, ProtocolError
from specsplit.cloud.gateway.start import open_session
from specsplit.cloud.gateway.stream_policy import StreamPolicy
from specsplit.cloud.gateway.triton_client import (
    SessionLost,
    TargetFull,
    TritonRequestError,
    TritonSequence,
    TritonUnavailable,
)
from specsplit.shared.protocol import (
    PROTOCOL_VERSION,
    SERVICE_NAME,
    SESSION_MODE_TO_PB,
    VERIFICATION_TO_PB,
    pb,
    pb_grpc,
)
from specsplit.shared.session_mode import SessionMode

log = logging.getLogger(__name__)


_STATUS = {c: getattr(grpc.StatusCode, c.value) for c in Code}
STEPS_KEPT = 64  # target passes behind Started.step_ms
# A live session is silent at the target for at most the idle timeout (a client's Draft, or a
# send it does not read) and a round: its lease there is that plus this.
LEASE_MARGIN_S = 30.0
RECLAIM_POLL_S = 0.01  # while a reclaimed stream ends, how often its place is looked for
RECLAIMED = (
    "session reclaimed: idle while the server was full; "
    "retry with the committed sequence as the prompt"
)
T = TypeVar("T")


class SpeculativeService(pb_grpc.SpeculativeDecodingServicer):
    def __init__(
        self,
        replicas: ReplicaSet,
        model: ModelIdentity,
        policy: StreamPolicy | None = None,
        sequence_factory: Callable[
            [aioclient.InferenceServerClient], TritonSequence
        ] = TritonSequence,
        admission: Admission | None = None,
        quota_by_token: bool = False,  # the port requires tokens: quotas count tokens, not peers
    ):
        self.replicas = replicas
        self.admission = admission or Admission()
        self.quota_by_token = quota_by_token
        self.sequence_factory = sequence_factory  # tests pass fakes
        self.model = model
        self.policy = policy or StreamPolicy()
        self.metrics = GatewayMetrics(replicas)  # observes the protocol around Generate
        self.metrics.watch_admission(self.admission)
        self.gate = RetryGate()  # clients told to retry later, until when (every refusal's hint)
        self.metrics.watch_gate(self.gate)
        self.steps = StepTime(STEPS_KEPT)  # recent target passes, as one-row steps
        self._closing: set[asyncio.Task] = set()  # Triton frees in flight: close() waits
        self._ending: set[asyncio.Future] = set()  # statuses sent from outside a handler
        self.health_task: asyncio.Task | None = None

    @property
    def active(self) -> int:
        """Open streams (counted by Admission, the one owner of that number)."""
        return self.admission.open

    async def close(self) -> None:
        if self.health_task is not None:
            self.health_task.cancel()
        if self._closing:
            await asyncio.wait(self._closing, timeout=10)
        await self.replicas.close()

    async def Generate(self, requests, context) -> AsyncIterator[pb.ServerMessage]:
        """admit -> open -> (Probe, for a client that asked) -> Started -> the mode's rounds
        -> Finished."""
        client = self._client(context)
        try:
            # A client told to wait (a retry hint) has this stream held until then, unread.
            refused = await self.gate.hold(client)
            if refused is not None:
                raise refused
            ticket = await _admitted(lambda: self.admission.enter(client))
        except Refused as e:
            if e.reason == RETRY_EARLY:  # too many held: refused without reading anything
                await before_refusing_unread()
            else:
                await before_refusing(requests)
            await self._refuse(context, client, e)
        handler = asyncio.current_task()
        ticket.attach(StreamHandle(ticket, handler, context, self._background))
        lease = Lease(self.replicas, self._sequences(client))
        messages, session = Echoes(_Marked(requests.__aiter__(), ticket)), None
        tail = ReadingTail()  # a cloud-led loop leaves its reader here, still reading
        try:
            first = await next_message(messages, self.policy.start_timeout_s, "Start")
            if first is not None:  # else the client half-closed without a Start
                with ticket.working():
                    ticket.started = True
                    t_start = time.perf_counter()
                    session, mode = open_session(first, self.model)
                if self._probes(first.start, mode):  # the round trip, timed during prefill
                    with self._sending(ticket):
                        yield pb.ServerMessage(probe=pb.Probe())
                    messages.probe_sent()
                with ticket.working():
                    t_queue = time.perf_counter()
                    # The prompt's slot only: what it may grow to is reserved as it grows.
                    await self._reserve(ticket, lease, session.committed_len)
                    self.metrics.observe_queue(time.perf_counter() - t_queue)
                    await lease.start(
                        session.prompt,
                        session.sampling,
                        session.verification,
                        session.seed,
                        mode.drafts,
                    )
                    self._observe_target(lease)
                started = self._started(session, mode, t_start, first.start.follows_lead)
                with self._sending(ticket):
                    yield pb.ServerMessage(started=started)
                reserve = lambda n: self._reserve(ticket, lease, n)  # noqa: E731
                step = Round(session, lease, self.steps, ticket.working, reserve)
                lead_after_s = started.lead_after_ms / 1e3
                async for verdict in self._rounds(mode, step, messages, lead_after_s, tail):
                    with self._sending(ticket):
                        yield pb.ServerMessage(verdict=verdict)
                with self._sending(ticket):
                    yield pb.ServerMessage(finished=_finished(session))
        except TargetFull as e:  # the target's own KV capacity: as retryable as the budget's
            wait_ms = self.admission.retry_after_ms()
            await messages.settle()
            await self._refuse(
                context, client, Refused(_target_full(e, wait_ms), wait_ms, TARGET_KV)
            )
        except Refused as e:
            await messages.settle()
            await self._refuse(context, client, e)
        except (ProtocolError, SessionLost, TritonUnavailable, TritonRequestError) as e:
            await messages.settle()
            await context.abort(*_status(e))
        except (asyncio.CancelledError, Reclaimed):
            if not ticket.reclaimed:
                raise  # the client cancelled, the server stops, or a send stalled (_end)
            if handler.cancelling():
                handler.uncancel()
            tail.reader = None  # nothing more to read: the stream ends now
            if context.code() is None:  # else _end sent it, from outside a stuck send
                await context.abort(grpc.StatusCode.UNAVAILABLE, RECLAIMED)
        finally:
            messages.close()
            ticket.leave()  # drops its StreamHandle: nothing ends this stream from outside now
            self._release(lease, ticket)
        # A cloud-led loop's reader reads on until the half-close; else read here until then
        await until_half_close(requests, self.policy.half_close_grace_s, tail.reader)

    async def _refuse(self, context, client: str | None, e: Refused) -> None:
        """Ends a stream with RESOURCE_EXHAUSTED; its client is held to the retry hint."""
        self.gate.told(client, e.retry_after_ms)
        self.metrics.refused_stream(e.reason)
        await context.abort(*_status(e))

    def _background(self, coro) -> None:
        # Not among the tasks close() waits for: a status behind unread messages may never go.
        task = asyncio.ensure_future(coro)
        self._ending.add(task)
        task.add_done_callback(self._ending.discard)

    async def _rounds(
        self, mode: SessionMode, step: Round, messages, lead_after_s: float, tail: ReadingTail
    ) -> AsyncIterator[pb.Verdict]:
        """The session's mode switch, the one place a mode meets its loop: a lock-step loop
        ends in a Handover (cloud.gateway.handover) when the session goes on cloud-led; the
        switch is one way. A cloud-led loop leaves its still-reading reader in ``tail``."""
        handover: Handover | None = None
        while True:
            if mode is SessionMode.CLOUD_ONLY:
                rounds = cloud_only_rounds(step, messages)
            elif mode is SessionMode.CLOUD_LED:
                rounds = cloud_led_rounds(step, messages, tail, handover)
            else:
                idle_s = self.policy.idle_timeout_s
                rounds = lockstep_rounds(step, messages, idle_s, lead_after_s)
            handover = None
            async with contextlib.aclosing(rounds):  # closed with the stream, even mid-loop
                async for out in rounds:
                    if isinstance(out, Handover):
                        handover = out
                    else:
                        yield out
            if handover is None:
                return
            mode = SessionMode.CLOUD_LED

    @contextlib.contextmanager
    def _sending(self, ticket: Ticket) -> Iterator[None]:
        """One message out. A client that reads nothing for ``idle_timeout_s`` (gRPC flow
        control holds the send) has its stream ended, like one that writes nothing."""
        idle_s = self.policy.idle_timeout_s
        stalled = (grpc.StatusCode.DEADLINE_EXCEEDED, f"the client read nothing for {idle_s:g} s")
        timer = asyncio.get_running_loop().call_later(idle_s, ticket.control.end, *stalled)
        try:
            with ticket.sending():
                yield
        finally:
            timer.cancel()

    async def _reserve(self, ticket: Ticket, lease: Lease, committed_len: int) -> None:
        """The KV slot of a session at ``committed_len``, reserved before Triton may grow it;
        waits while reclaimed idle sessions make room, else raises Refused."""
        # A session re-opened on another replica counts at what that replica reported.
        self.admission.observe_kv(lease.replica.url, lease.kv_bytes_per_token)
        await _admitted(lambda: ticket.reserve(committed_len))

    def _observe_target(self, lease: Lease) -> None:
        """What the target reported with the session's start: its bytes per KV position, its
        KV capacity and what it holds (admission counts against them)."""
        url, triton = lease.replica.url, lease.triton
        self.admission.observe_kv(url, lease.kv_bytes_per_token)
        capacity, held = getattr(triton, "kv_capacity", None), getattr(triton, "kv_held", None)
        self.admission.observe_capacity(url, capacity, held)

    def _sequences(self, client: str | None) -> Callable[[object], TritonSequence]:
        """The sequence factory for one stream: each sequence tells the target its client (a
        quota's key, hashed: the target shares prefill rows per pass among clients) and its
        lease (the longest this gateway leaves a live session silent, plus a margin)."""
        share = 0
        if client is not None:
            digest = hashlib.blake2b(client.encode(), digest_size=8).digest()
            share = int.from_bytes(digest) >> 1 or 1
        lease_s = self.policy.idle_timeout_s + LEASE_MARGIN_S
        factory = self.sequence_factory

        def make(triton_client) -> TritonSequence:
            sequence = factory(triton_client)
            sequence.client_share, sequence.lease_s = share, lease_s
            return sequence

        return make

    def _client(self, context) -> str | None:
        token = bearer_token(context.invocation_metadata()) if self.quota_by_token else None
        return client_key(token, context.peer(), self.quota_by_token)

    def _release(self, lease: Lease, ticket: Ticket) -> None:
        # Freeing the Triton sequence runs in its own task: a client that cancels the call right
        # after Finished (or mid-generation) cancels this handler, and must not leak the KV cache.
        # Its KV reservation ends when Triton has freed the cache, not before.
        task = asyncio.create_task(lease.release())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        task.add_done_callback(lambda _: ticket.free())

    def _probes(self, start: pb.Start, mode: SessionMode) -> bool:
        """A Probe for this Start: its client asked (Start.probe) in a session the server may
        lead (Started.lead_after_ms > 0), where the round trip can make it lead sooner."""
        asked = start.probe and start.follows_lead
        return lead_after_ms(asked, mode, self.steps.ms) > 0

    def _started(
        self, session: GatewaySession, mode: SessionMode, t_start: float, follows_lead: bool
    ) -> pb.Started:
        lim = self.model.limits
        step_ms = self.steps.ms
        return pb.Started(
            session_id=uuid.uuid4().hex,
            model=self.model.to_pb(),
            limits=pb.Limits(
                max_draft_tokens=lim.max_draft_tokens,
                max_context=lim.max_context,
                max_q_entries=lim.max_q_entries,
            ),
            protocol_version=PROTOCOL_VERSION,
            verification=VERIFICATION_TO_PB[session.verification],
            committed_len=session.committed_len,
            max_new_tokens=session.max_new_tokens,
            seed=session.seed,
            q_counts=True,
            session_mode=SESSION_MODE_TO_PB[mode],
            accepts_lead=True,
            step_ms=step_ms,
            lead_after_ms=lead_after_ms(follows_lead, mode, step_ms),
            setup_ms=(time.perf_counter() - t_start) * 1e3,
        )


class StreamHandle:
    """One stream's handler task and call context: ends the stream from outside the handler,
    for the reclaim policy (``reclaim``) and for a send that stalled (``end``). What a ticket
    holds (cloud.gateway.admission.StreamControl), so admission never reaches the servicer."""

    def __init__(
        self,
        ticket: Ticket,
        handler: asyncio.Task,
        context,
        background: Callable[[Awaitable[None]], None],
    ):
        self.ticket, self.handler, self.context = ticket, handler, context
        self.background = background  # runs a status send outside the handler

    def end(self, code: grpc.StatusCode, details: str) -> None:
        if self.ticket.in_send:
            # Cancelled inside gRPC's send, the handler can no longer send a status: sent from
            # here, it reaches the client behind the messages it has not read yet.
            self.background(_abort(self.context, code, details))
        self.handler.cancel()

    def reclaim(self) -> None:
        # only ever while the stream is idle (cloud.gateway.admission)
        self.end(grpc.StatusCode.UNAVAILABLE, RECLAIMED)


class _Marked:
    """A stream's client messages, each marking its ticket active (the reclaim policy's clock)."""

    def __init__(self, messages: AsyncIterator, ticket: Ticket):
        self.messages, self.ticket = messages, ticket

    def __aiter__(self) -> _Marked:
        return self

    async def __anext__(self):
        msg = await anext(self.messages)
        self.ticket.touch()
        return msg


def _target_full(e: TargetFull, wait_ms: int) -> str:
    detail = str(e).split("KV_CAPACITY_EXCEEDED:", 1)[-1].strip()
    return (
        f"the target refused more KV memory ({detail}); retry in {wait_ms} ms with the committed "
        "sequence as the prompt, or on another replica"
    )


async def _admitted(attempt: Callable[[], T]) -> T:
    """``attempt()`` (an admission), asked again while reclaimed idle streams are ending, for
    at most RECLAIM_WAIT_S; then the refusal stands, with its retry hint."""
    deadline = time.monotonic() + RECLAIM_WAIT_S
    while True:
        try:
            return attempt()
        except Reclaiming as e:
            if time.monotonic() > deadline:
                raise Refused(
                    f"server full: idle sessions did not end in time; retry in "
                    f"{e.retry_after_ms} ms, or on another replica",
                    e.retry_after_ms,
                    e.reason,
                ) from None
            await asyncio.sleep(RECLAIM_POLL_S)


async def _abort(context, code: grpc.StatusCode, details: str) -> None:
    with contextlib.suppress(Exception):  # AbortError once sent; a call that already ended
        await context.abort(code, details)


def _finished(session: GatewaySession) -> pb.Finished:
    return pb.Finished(
        committed_len=session.committed_len,
        reason=int(session.finish),
        target_forward_passes=session.rounds,
        drafts_dropped=session.drafts_dropped,
        drafts_used=session.drafts_used,
    )


def _status(e: Exception) -> tuple:
    """The status (code, details[, trailing metadata]) a stream ends with for ``e``."""
    if isinstance(e, Refused):  # the Start was received: the client reads this status
        return grpc.StatusCode.RESOURCE_EXHAUSTED, e.message, e.trailing_metadata()
    if isinstance(e, ProtocolError):
        return _STATUS[e.code], e.message
    if isinstance(e, SessionLost):  # lost again right after a re-open: Triton is restarting
        log.warning("session lost twice in one round: %s", e)
        return (
            grpc.StatusCode.UNAVAILABLE,
            "inference server lost the session twice in one round; "
            "retry with the committed sequence as the prompt",
        )
    if isinstance(e, TritonUnavailable):
        log.warning("inference server unavailable: %s", e)
        return grpc.StatusCode.UNAVAILABLE, "inference server unavailable"
    log.error("inference server refused a validated request: %s", e)
    return grpc.StatusCode.INTERNAL, f"inference server error: {e}"


async def start_gateway(
    triton_url: str | list[str],
    model: ModelIdentity,
    host: str = "127.0.0.1",
    port: int = 0,
    policy: StreamPolicy | None = None,
    security: Security | None = None,
    sequence_factory: Callable[[aioclient.InferenceServerClient], TritonSequence] = TritonSequence,
    failover_wait_s: float = 30.0,
    admission: Admission | None = None,
) -> tuple[grpc.aio.Server, int, SpeculativeService]:
    """Starts the gateway in front of one Triton or several (``host:port`` each); returns
    (server, bound port, service). Port 0 picks a free port."""
    policy, security = policy or StreamPolicy(), security or Security()
    urls = parse_urls(triton_url) if isinstance(triton_url, str) else list(triton_url)
    replicas = ReplicaSet(urls, failover_wait_s=failover_wait_s)
    service = SpeculativeService(
        replicas, model, policy, sequence_factory, admission, security.tokens is not None
    )
    interceptors = security.interceptors(on_refused=service.metrics.refused)
    server = grpc.aio.server(interceptors=interceptors, options=policy.server_options())
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
