"""Prometheus metrics of the gateway (docs/design.md#operations), named after vLLM's spec-decode
metrics.

Observed from the protocol itself: ``GatewayMetrics.instrument`` wraps the Generate handler and
sees each ClientMessage (Start: the stream's route), each ServerMessage (Verdict: the draft
tokens its step verified, accepted tokens, bonus, timings; Finished: the reason) and the status
the stream ends with.

What a Verdict counts for (drafted = the draft tokens the target verified, accepted, emitted;
whether its step was a draft) is ``shared.spec_counts.StepCounts``, the one definition the
edge's ``GenerationStats`` counts by too, in every session mode, so the two agree exactly.

Request latency, named after vLLM's and measured at the gateway, per stream (a re-opened stream
is a new request, as a vLLM retry is): time to first token (from the Start's arrival to the
first message that commits a token), inter-token latency (between two successive messages that
commit tokens; once per message, as vLLM observes once per engine step, however many tokens it
commits), end-to-end (Start to Finished) and queue time (Start to its admission: places and KV
reserved, the wait while reclaimed idle streams make room included; ``observe_queue``, called by
the service). Prompt tokens are counted at each Start, generation tokens at each Verdict.

Each service owns a private ``CollectorRegistry``: several gateways in one process (tests) never
share or collide on a metric. Triton replicas are read at scrape time, one label per replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from http.server import ThreadingHTTPServer

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from specsplit.shared.protocol import pb
from specsplit.shared.request_latency import E2E_S, latency_histograms
from specsplit.shared.session_mode import SessionMode
from specsplit.shared.spec_counts import StepCounts

log = logging.getLogger(__name__)

PREFIX = "specsplit"
SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
POWERS_OF_TWO = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
ACCEPTANCE_LENGTHS = tuple(range(1, 18))  # emitted per draft: 1 .. max_draft_tokens + 1
# Finished.reason -> outcome label; UNSPECIFIED (a split stream the client half-closed) is none.
_FINISH = {int(v): n.removeprefix("FINISH_REASON_").lower() for n, v in pb.FinishReason.items()}
_FINISH[0] = ""


@dataclass
class _Stream:
    """What one Generate stream has shown so far."""

    route: str = "none"  # "split" or "cloud-only" once Start arrived
    outcome: str = ""  # the finish reason, once Finished is sent
    started_at: float | None = None  # perf_counter at the Start's arrival
    last_token_at: float | None = None  # perf_counter at the last message committing tokens


class _Requests:
    """The client's messages, observed on their way to the handler. A plain iterator class, not
    an async generator: a cancelled ``__anext__`` (the handler's timeouts) must not close it."""

    def __init__(self, requests, metrics: GatewayMetrics, stream: _Stream):
        self._it, self._metrics, self._stream = requests.__aiter__(), metrics, stream

    def __aiter__(self) -> _Requests:
        return self

    async def __anext__(self):
        msg = await self._it.__anext__()
        self._metrics.observe_request(self._stream, msg)
        return msg


class ReplicaCollector:
    """Per-replica health and load, read from the ReplicaSet at scrape time."""

    def __init__(self, replicas):
        self.replicas = replicas

    def collect(self):
        up = GaugeMetricFamily(
            f"{PREFIX}_triton_replica_up",
            "1 while the replica's target is ready",
            labels=["replica"],
        )
        sessions = GaugeMetricFamily(
            f"{PREFIX}_triton_replica_sessions",
            "this gateway's sessions placed on the replica",
            labels=["replica"],
        )
        failures = CounterMetricFamily(
            f"{PREFIX}_triton_replica_failures",
            "times the replica was marked down after a failed call",
            labels=["replica"],
        )
        for r in list(self.replicas.replicas):
            up.add_metric([r.url], float(r.up))
            sessions.add_metric([r.url], float(r.sessions))
            failures.add_metric([r.url], float(r.failures))
        yield from (up, sessions, failures)


class _TargetKVCollector:
    """Each replica's KV capacity and what every gateway's sessions hold there, as it reported
    them with this gateway's last session start on it."""

    def __init__(self, admission):
        self.admission = admission

    def collect(self):
        capacity = GaugeMetricFamily(
            f"{PREFIX}_target_kv_capacity_bytes",
            "KV memory the target may hold (its report)",
            labels=["replica"],
        )
        held = GaugeMetricFamily(
            f"{PREFIX}_target_kv_held_bytes",
            "KV memory every gateway's sessions hold on the target (its last report)",
            labels=["replica"],
        )
        for replica, (cap, all_held) in list(self.admission.reported_kv.items()):
            capacity.add_metric([replica], float(cap))
            held.add_metric([replica], float(all_held))
        yield from (capacity, held)


class _GateCollector:
    def __init__(self, gate):
        self.gate = gate

    def collect(self):
        yield CounterMetricFamily(
            f"{PREFIX}_held_streams",
            "streams held, unread, until their client's retry hint ran out",
            value=float(self.gate.holds),
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_held_streams_now",
            "streams held now until their client's retry hint runs out",
            value=float(sum(self.gate.held.values())),
        )


class GatewayMetrics:
    def __init__(self, replicas=None):
        self.registry = reg = CollectorRegistry()
        p = PREFIX
        self.sessions_active = Gauge(f"{p}_sessions_active", "open Generate streams", registry=reg)
        self.sessions = Counter(
            f"{p}_sessions", "ended streams", ["route", "outcome"], registry=reg
        )
        self.rounds = Counter(f"{p}_rounds", "verification rounds", ["route"], registry=reg)
        self.committed = Counter(
            f"{p}_tokens_committed", "tokens committed to clients", ["route"], registry=reg
        )
        spec = f"{p}_spec_decode"
        self.drafts = Counter(f"{spec}_num_drafts", "drafts verified (k > 0)", registry=reg)
        self.drafted = Counter(f"{spec}_num_draft_tokens", "tokens drafted", registry=reg)
        self.accepted = Counter(f"{spec}_num_accepted_tokens", "drafts accepted", registry=reg)
        self.emitted = Counter(
            f"{spec}_num_emitted_tokens", "accepted + bonus tokens of drafts", registry=reg
        )
        self.accepted_per_pos = Counter(
            f"{spec}_num_accepted_tokens_per_pos",
            "drafts whose token at this position was accepted",
            ["position"],
            registry=reg,
        )
        self.acceptance_length = Histogram(
            f"{spec}_acceptance_length",
            "tokens emitted per draft (accepted + bonus)",
            buckets=ACCEPTANCE_LENGTHS,
            registry=reg,
        )
        self.server_s, self.verify_s, self.queue_s = (
            Histogram(f"{p}_round_{name}_seconds", doc, buckets=SECONDS, registry=reg)
            for name, doc in (
                ("server", "a round at the gateway, request to verdict"),
                ("verify", "the target's forward pass serving a round"),
                ("triton_queue", "a round's time in Triton beyond its forward pass"),
            )
        )
        self.batch_rows = Histogram(
            f"{p}_target_batch_rows",
            "rows of the forward pass that served a round",
            buckets=POWERS_OF_TWO,
            registry=reg,
        )
        self.batch_sessions = Histogram(
            f"{p}_target_batch_sessions",
            "sessions in the forward pass that served a round",
            buckets=POWERS_OF_TWO,
            registry=reg,
        )
        latency = latency_histograms(
            p,
            reg,
            ttft_doc="Start's arrival to the first message committing a token",
            itl_doc="between two successive messages committing tokens",
            e2e_doc="Start's arrival to Finished",
        )
        self.ttft_s, self.itl_s, self.e2e_s = latency.ttft, latency.itl, latency.e2e
        self.queue_time_s = Histogram(
            f"{p}_request_queue_time_seconds",
            "Start's arrival to its admission (places and KV reserved)",
            buckets=E2E_S,
            registry=reg,
        )
        self.prompt_tokens = Counter(
            f"{p}_prompt_tokens", "prompt tokens of the Starts received", registry=reg
        )
        self.generation_tokens = Counter(
            f"{p}_generation_tokens", "tokens generated (committed after the prompt)", registry=reg
        )
        self.bytes_in = Counter(f"{p}_received_bytes", "client message bytes", registry=reg)
        self.bytes_out = Counter(f"{p}_sent_bytes", "server message bytes", registry=reg)
        self.errors = Counter(f"{p}_errors", "streams ended with an error", ["code"], registry=reg)
        self.refused_streams = Counter(
            f"{p}_refused_streams",
            "streams refused (RESOURCE_EXHAUSTED or UNAUTHENTICATED), by what ran out",
            ["reason"],
            registry=reg,
        )
        self.replicas_up = Gauge(
            f"{p}_triton_replicas_up", "Triton replicas whose target is ready", registry=reg
        )
        if replicas is not None:
            self.replicas_up.set_function(lambda: float(replicas.up))
            reg.register(ReplicaCollector(replicas))

    def instrument(self, handler: Callable) -> Callable:
        """Wraps a stream-stream Generate handler ``(requests, context) -> messages``."""

        async def generate(requests, context) -> AsyncIterator[pb.ServerMessage]:
            stream = _Stream()
            self.sessions_active.inc()
            messages = handler(_Requests(requests, self, stream), context)
            try:
                # aclosing: when grpc drops this generator, the handler's own cleanup (its
                # session's KV cache) runs now, not when the garbage collector gets to it.
                async with contextlib.aclosing(messages):
                    async for msg in messages:
                        self.observe_response(stream, msg)
                        yield msg
            except BaseException as e:
                self.observe_end(stream, _code(context, e))
                raise
            else:
                self.observe_end(stream, _code(context, None))
            finally:
                self.sessions_active.dec()

        return generate

    def observe_request(self, stream: _Stream, msg) -> None:
        if not isinstance(msg, pb.ClientMessage):  # undecodable: the handler refuses it
            return
        self.bytes_in.inc(msg.ByteSize())
        kind = msg.WhichOneof("msg")
        if kind == "start":
            stream.route = _route_label(msg.start)
            stream.started_at = time.perf_counter()
            self.prompt_tokens.inc(len(msg.start.prompt_ids))

    def observe_response(self, stream: _Stream, msg: pb.ServerMessage) -> None:
        self.bytes_out.inc(msg.ByteSize())
        kind = msg.WhichOneof("msg")
        if kind == "verdict":
            # Read from the Verdict alone, in every mode (a lock-step stream may turn cloud-led
            # mid-way, where Drafts and Verdicts do not pair up).
            emitted = self.observe_verdict(stream.route, msg.verdict)
            if emitted:
                self._observe_tokens(stream, time.perf_counter())
        elif kind == "finished":
            stream.outcome = _FINISH.get(msg.finished.reason, "")
            if stream.started_at is not None:
                self.e2e_s.observe(time.perf_counter() - stream.started_at)

    def _observe_tokens(self, stream: _Stream, now: float) -> None:
        if stream.last_token_at is not None:
            self.itl_s.observe(now - stream.last_token_at)
        elif stream.started_at is not None:
            self.ttft_s.observe(now - stream.started_at)
        stream.last_token_at = now

    def observe_queue(self, seconds: float) -> None:
        """A Start admitted ``seconds`` after it arrived (the service's call)."""
        self.queue_time_s.observe(seconds)

    def observe_verdict(self, route: str, v: pb.Verdict) -> int:
        """Counts one Verdict; returns the tokens it commits."""
        step = StepCounts.of(v)
        self.rounds.labels(route).inc()
        self.committed.labels(route).inc(step.emitted)
        self.generation_tokens.inc(step.emitted)
        if step.is_draft:
            self.drafts.inc()
            self.drafted.inc(step.drafted)
            self.accepted.inc(step.accepted)
            self.emitted.inc(step.emitted)
            self.acceptance_length.observe(step.emitted)
            for pos in range(step.accepted):
                self.accepted_per_pos.labels(str(pos)).inc()
        t = v.timings
        self.server_s.observe(t.server_ms / 1e3)
        self.verify_s.observe(t.verify_ms / 1e3)
        self.queue_s.observe(t.queue_ms / 1e3)
        if t.batch_rows:
            self.batch_rows.observe(t.batch_rows)
            self.batch_sessions.observe(t.batch_sessions)
        return step.emitted

    def watch_admission(self, admission) -> None:
        """KV memory as ``cloud.gateway.admission`` counts it and as the targets report it,
        read at scrape time."""
        for name, attr, doc in (
            ("kv_budget_bytes", "budget_bytes", "KV memory sessions may hold (0: no budget)"),
            ("kv_reserved_bytes", "reserved_bytes", "KV memory this gateway's sessions reserve"),
            ("kv_bytes_per_token", "bytes_per_token", "what one KV position counts (the target's)"),
            (
                "kv_limit_bytes",
                "limit_bytes",
                "KV memory this gateway's sessions may reserve now: the budget, or the targets' "
                "room left for them where smaller (0: no limit)",
            ),
        ):
            gauge = Gauge(f"{PREFIX}_{name}", doc, registry=self.registry)
            gauge.set_function(lambda attr=attr: float(getattr(admission, attr) or 0))
        self.registry.register(_TargetKVCollector(admission))

    def watch_gate(self, gate) -> None:
        """Streams ``cloud.gateway.retry_gate.RetryGate`` holds to their client's retry hint."""
        self.registry.register(_GateCollector(gate))

    def refused(self, method: str) -> None:
        """A call refused before any handler ran (a missing or wrong bearer token)."""
        if method.endswith("/Generate"):
            self.errors.labels(grpc.StatusCode.UNAUTHENTICATED.name).inc()
            self.sessions.labels("none", "unauthenticated").inc()
            self.refused_stream("unauthenticated")

    def refused_stream(self, reason: str) -> None:
        """A stream refused for ``reason`` (``cloud.gateway.admission.Refused.reason``)."""
        self.refused_streams.labels(reason).inc()

    def observe_end(self, stream: _Stream, code: grpc.StatusCode | str | None) -> None:
        if isinstance(code, grpc.StatusCode) and code is not grpc.StatusCode.OK:
            outcome = code.name.lower()
            self.errors.labels(code.name).inc()
        elif stream.outcome:  # a finish reason: the generation ran to its end
            outcome = stream.outcome
        elif isinstance(code, str):
            outcome = code
        else:  # the client half-closed, before its Start or between rounds
            outcome = "client_closed" if stream.route != "none" else "no_start"
        self.sessions.labels(stream.route, outcome).inc()


def _code(context, error: BaseException | None) -> grpc.StatusCode | str | None:
    """How a stream ended: the status the handler set (``context.abort``); UNKNOWN for an
    exception that escaped it (grpc reports that); "client_cancelled" when the call was."""
    try:
        code, cancelled = context.code(), context.cancelled()
    except Exception:  # a test double without them
        code, cancelled = None, False
    if code is not None and not isinstance(code, grpc.StatusCode):
        code = next((c for c in grpc.StatusCode if c.value[0] == code), None)
    if isinstance(error, asyncio.CancelledError | GeneratorExit):
        # A status we sent from outside the handler (a stalled send) is how the stream ended.
        return code if code not in (None, grpc.StatusCode.OK) else "client_cancelled"
    if code is None and error is not None:
        return grpc.StatusCode.UNKNOWN
    # A cancelled call ends the request stream like a half-close: the handler may end normally.
    return "client_cancelled" if code is None and cancelled else code


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> ThreadingHTTPServer:
    """Serves ``/metrics`` from a daemon thread; returns the server (``server_port`` is the bound
    port when ``port`` is 0). Stop it with ``shutdown()`` then ``server_close()``."""
    server, _thread = start_http_server(port, addr=host, registry=registry)
    log.info("metrics on http://%s:%d/metrics", host, server.server_port)
    return server


def _route_label(start: pb.Start) -> str:
    # An unknown session_mode is refused by the handler and counted as split.
    cloud_only = start.session_mode == pb.SESSION_MODE_CLOUD_ONLY
    return str(SessionMode.CLOUD_ONLY) if cloud_only else "split"
