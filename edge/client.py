"""Async client API for applications: the draft -> send -> commit loop of docs/design.md#protocol.

    async with SplitClient("127.0.0.1:50051", drafter) as client:
        gen = client.generate(prompt_ids, GenerationConfig(max_new_tokens=64))
        async for tokens in gen:      # committed tokens, as each verdict arrives
            ...
        print(gen.stats.acceptance_rate)

Modes: "split" (draft on the edge, verify in the cloud), "cloud-only" (the target alone in the
cloud, streamed), "edge-only" (the draft alone, no network). gRPC errors are caught here, in one
place, and raised as ``SpecsplitError`` with the status code.

A generation is one stream, re-opened from what it committed after an outage (edge.retry). Each
stream gets its ``SessionPlan`` (edge.session_plan) and runs Start to Finished in edge.rounds:
the transport is edge.stream, drafts come from a ``Proposer`` (edge.proposer), and the rounds
are the loop of the session mode (edge.lockstep, edge.cloud_led, edge.cloud_only).
"""

from __future__ import annotations

import asyncio
import ipaddress
import secrets
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc

from specsplit.edge.channel import open_channel
from specsplit.edge.drafting import Drafter, generate_edge_only
from specsplit.edge.generation import (  # noqa: F401 (GenerationConfig, GenerationStats: re-exported)
    Generation,
    GenerationConfig,
    GenerationStats,
)
from specsplit.edge.mode_switch import MIN_ROUNDS, Link
from specsplit.edge.proposer import Proposer, as_proposer
from specsplit.edge.retry import (
    HANDSHAKE_HINT,
    Backoff,
    refused_at_handshake,
    retry_after_s,
)
from specsplit.edge.rounds import run_rounds
from specsplit.edge.session_plan import SessionPlan
from specsplit.edge.stream import SpecsplitError, Stream
from specsplit.shared.protocol import pb_grpc
from specsplit.shared.seeding import round_rng
from specsplit.shared.session_mode import SessionMode

# The route: where tokens come from. Draft and verify (session mode lock-step, cloud-led or
# auto), the target alone (session mode cloud-only, spelt the same), the draft alone (no session).
CLOUD_ONLY = SessionMode.CLOUD_ONLY.value
ROUTES = ("split", CLOUD_ONLY, "edge-only")
SERVE_ROUTES = ROUTES[:2]  # the OpenAI endpoint's: a server has no edge-only


def check_token_transport(address: str | None, token: str | None, secure: bool, insecure: bool):
    """Raises ValueError where a bearer token would go in plaintext to an address off this host
    (unless ``insecure`` says to send it anyway)."""
    if token and address and not secure and not insecure and not is_loopback(address):
        raise ValueError(
            f"refusing to send the bearer token in plaintext to {address}: connect with "
            "TLS (--tls or --tls-ca), or pass --insecure to send it anyway"
        )


class SplitClient:
    """A connection to a gateway. TLS when ``tls`` is true or any tls_* file is given;
    ``token`` is sent as ``authorization: Bearer <token>`` on every call, never in plaintext to
    an address off this host unless ``insecure`` (ValueError: anyone on the path could read it
    and use it). ``drafter``: the draft model (drafting through ``edge.proposer.as_proposer``:
    ``DraftModelProposer``, behind a checked ``PromptLookupProposer`` for an ONNX draft), or any
    ``Proposer`` (the load benchmark's replay of recorded blocks)."""

    def __init__(
        self,
        address: str | None,
        drafter: Drafter | Proposer | None = None,
        *,
        tls: bool = False,
        tls_ca: str | Path | None = None,
        tls_cert: str | Path | None = None,
        tls_key: str | Path | None = None,
        token: str | None = None,
        link: Link | None = None,
        insecure: bool = False,
    ):
        secure = bool(tls or tls_ca or tls_cert or tls_key)
        check_token_transport(address, token, secure, insecure)
        self.address = address
        self.drafter = drafter
        self.proposer = None if drafter is None else as_proposer(drafter)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._channel = None
        if address:
            tls_files = dict(tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key)
            self._channel = open_channel(address, tls=tls, **tls_files)
            # connects now, not at the first generation: an app that opens its client ahead
            # (or checks health over ``channel``) starts with the handshake done
            self._channel.get_state(try_to_connect=True)
        self._stub = pb_grpc.SpeculativeDecodingStub(self._channel) if self._channel else None
        self._reached = False  # a Started came back once: the link and its credentials work
        # (round trip, target step) from the last Started of a server that serves auto: a
        # generation in auto starts cloud-led when it is LEAD_AT_START steps (edge.mode_switch),
        # instead of spending its first round trip to learn it again; every Started renews it.
        self._link: Link | None = link

    @property
    def channel(self) -> grpc.aio.Channel | None:
        """The gRPC channel to the gateway (None for edge-only): its connection is the one
        every generation of this client uses."""
        return self._channel

    @property
    def link(self) -> Link | None:
        """The round trip and server step the last Started reported (None before one came
        back from a server that serves auto). An app that opens a client per request can pass
        it to the next one (``SplitClient(..., link=old.link)``): that client's first auto
        generation then starts as this one's last Started says, cloud-led where the link is
        slow, without spending a round trip to learn it again."""
        return self._link

    async def __aenter__(self) -> SplitClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()

    def generate(
        self, prompt_ids: Sequence[int], cfg: GenerationConfig, route: str = "split"
    ) -> Generation:
        if route not in ROUTES:
            raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
        if not prompt_ids:
            raise ValueError("prompt_ids must hold at least one token")
        if route != CLOUD_ONLY and self.drafter is None:
            raise ValueError(f"route {route} needs a drafter")
        if route != "edge-only" and self._stub is None:
            raise ValueError(f"route {route} needs a server address")
        if route != CLOUD_ONLY and max(prompt_ids) >= self.proposer.vocab_size:
            raise ValueError(
                f"prompt token id {max(prompt_ids)} outside the draft's vocabulary "
                f"[0, {self.proposer.vocab_size})"
            )
        limit = None if route == CLOUD_ONLY else self.proposer.max_positions
        if limit is not None and len(prompt_ids) >= limit:  # the draft must feed one more
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens: the draft runs at most {limit} positions "
                f"(its export's max_positions), and a generation needs one past the prompt; "
                f"shorten the prompt, or use route {CLOUD_ONLY} (no draft)"
            )
        stats = GenerationStats(route=route)
        if route == "edge-only":
            return Generation(self._edge_only(list(prompt_ids), cfg, stats), stats)
        return Generation(self._with_retries(list(prompt_ids), cfg, stats, route), stats)

    async def _edge_only(self, prompt, cfg, stats) -> AsyncIterator[list[int]]:
        seed = secrets.randbits(63) if cfg.seed is None else cfg.seed
        stats.observe_started(None, seed)  # no stream: no round trip, the edge's own seed
        rng = round_rng(seed, "edge-only", len(prompt))
        tokens = generate_edge_only(
            self.drafter, prompt, cfg.sampling, cfg.max_new_tokens, rng, frozenset(cfg.stop_ids)
        )
        last = None
        for last in tokens:
            yield [last]
            await asyncio.sleep(0)  # let other tasks run between tokens
        # Same reasons as the cloud reports, checked in the same order.
        if last in self.drafter.eos_token_ids:
            stats.observe_finished("EOS")
        elif last in cfg.stop_ids:
            stats.observe_finished("STOP_TOKEN")
        else:
            stats.observe_finished("LENGTH")

    async def _with_retries(self, prompt, cfg, stats, route) -> AsyncIterator[list[int]]:
        """Runs the session; after UNAVAILABLE, or RESOURCE_EXHAUSTED with a retry hint, re-opens
        with the committed sequence as prompt (edge/retry.py)."""
        committed = list(prompt)
        backoff = Backoff(cfg.retry_window_s)
        seed = _own_seed(cfg, route)
        while True:
            remaining = cfg.max_new_tokens - (len(committed) - len(prompt))
            plan = SessionPlan.of(cfg, route == CLOUD_ONLY, self._link)
            # A re-open sends the seed the first Started reported: sampling resumes unchanged.
            seed = seed if stats.seed is None else stats.seed
            stream = Stream(self._stub, self.metadata, cfg, stats, remaining, seed)
            try:
                async for chunk in run_rounds(stream, self.proposer, plan, committed):
                    committed += chunk
                    backoff.progress()
                    yield chunk
                return
            except grpc.aio.AioRpcError as e:
                # Never after the final Verdict: edge.rounds ends a stream whose goodbye is lost.
                if not (self._reached or stream.reached) and refused_at_handshake(e):
                    # A configuration error, not an outage: retrying cannot help.
                    raise SpecsplitError(e.code(), f"{e.details()} ({HANDSHAKE_HINT})") from None
                pause = None
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    pause = backoff.next_pause()
                elif e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    hint = retry_after_s(e)  # none: the client's own quota, waiting cannot help
                    pause = None if hint is None else backoff.next_pause(at_least=hint)
                if pause is None:
                    raise SpecsplitError(e.code(), e.details()) from None
                stats.retries += 1
                await asyncio.sleep(pause)
            finally:
                self._reached |= stream.reached
                self._link = _remembered(stream.link or self._link, plan, stats, self._link)
                await stream.close()


def _own_seed(cfg: GenerationConfig, route: str) -> int | None:
    """The seed a split request sends when it has none of its own: sampled, the edge picks one
    (as random as the server's pick: two requests differ, and Started reports it), so that its
    draft rule holds it before Started and the first block drafts while Start travels and the
    cloud prefills (edge.rounds), as a greedy one does; left to the server, the draft waited for
    Started. The plan still treats the request as unseeded (adaptive, free to switch modes)."""
    if cfg.seed is not None or cfg.sampling.greedy or route == CLOUD_ONLY:
        return cfg.seed
    return secrets.randbits(63)


def is_loopback(address: str) -> bool:
    """Whether a gRPC target (``host:port``, ``[v6]:port``, ``unix:path``, optionally with a
    ``dns:///`` or ``ipv4:``/``ipv6:`` scheme) names this host; a name other than localhost is
    not trusted to (DNS may send it anywhere)."""
    if address.startswith(("unix:", "unix-abstract:")):
        return True
    target = address.removeprefix("dns:///").removeprefix("ipv4:").removeprefix("ipv6:")
    host = target.rsplit(":", 1)[0] if target.count(":") == 1 or "]" in target else target
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _remembered(
    link: Link | None, plan: SessionPlan, stats: GenerationStats, before: Link | None = None
) -> Link | None:
    """The link a client keeps after a generation: what its Started measured, and, after an
    auto generation that measured enough rounds to judge (or started cloud-led), whether it ran
    cloud-led (edge.mode_switch.Link.led) and what each mode it ran yielded (the others' as
    ``before`` remembered them). A forced mode's generation, or the target alone's, judges
    nothing: its new round trip and step are kept beside what ``before`` had learnt."""
    if link is None:
        return link
    if not plan.auto:
        if before is None:
            return link
        return link._replace(led=before.led, lock_step=before.lock_step, cloud_led=before.cloud_led)
    link = link.measured(stats, before)
    led = stats.led_at_start or stats.lead_round > 0
    if led or stats.rounds >= MIN_ROUNDS + 1:
        return link._replace(led=led)
    return link
