"""One stream of a generation: Start, then the rounds of a session mode, until a final Verdict.

The round loops live in their own modules (``edge.lockstep``, ``edge.cloud_led``); this holds
what every mode shares: sending and receiving with byte counts, the first block drafted while the
cloud prefills, the draft-pair check and cloud-only streaming.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc

from specsplit.edge.drafting import Block, Drafter, guess_next, propose
from specsplit.edge.mode_switch import Link
from specsplit.edge.worker import Stoppable, Worker
from specsplit.shared.coupling import SharedNoise
from specsplit.shared.protocol import MODE_TO_PB, PROTOCOL_VERSION, pb, sampling_params

if TYPE_CHECKING:
    from specsplit.edge.client import GenerationConfig
    from specsplit.edge.generation import GenerationStats


class SpecsplitError(RuntimeError):
    def __init__(self, code: grpc.StatusCode | None, details: str):
        super().__init__(f"{code.name if code else 'ERROR'}: {details}")
        self.code = code
        self.details = details


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def reason_name(reason: int) -> str:
    return pb.FinishReason.Name(reason).removeprefix("FINISH_REASON_")


class Session:
    """One stream: Start, then rounds until a finished Verdict."""

    def __init__(
        self,
        stub,
        drafter,
        cfg: GenerationConfig,
        stats: GenerationStats,
        committed,
        max_new_tokens,
        seed,
        lead_at_start: bool = False,
    ):
        self.stub, self.drafter, self.cfg, self.stats = stub, drafter, cfg, stats
        # auto: start cloud-led (the client's previous Started measured a long round trip)
        self.lead_at_start = lead_at_start
        self.link: Link | None = None  # the round trip and step of a lead-aware Started
        self.committed = list(committed)  # own copy: the caller extends its list from chunks
        self.max_new_tokens = max_new_tokens
        self.seed: int | None = cfg.seed if seed is None else seed  # Started's, once it came
        self._noise: SharedNoise | None = None
        self.call = None
        self.metadata = None  # the call's metadata (the bearer token)
        self.final = ""  # the finish reason, once the final verdict came
        self.reached = False  # its Started arrived
        self.write_broke = False  # a write failed: grpc.aio then fails every read as INTERNAL

    async def send(self, msg: pb.ClientMessage) -> None:
        self.stats.bytes_up += msg.ByteSize()
        try:
            await self.call.write(msg)
        except asyncio.InvalidStateError:  # the server ended the call first: its status
            raise rpc_error(await self.call.code(), await self.call.details()) from None
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.INTERNAL:
                raise
            self.write_broke = True
            # grpc core could not send: the connection broke (a server's own INTERNAL status
            # would have ended the call before the write). Retryable, like any lost link.
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"stream broke: {e.details()}") from e

    async def recv(self, kind: str):
        try:
            msg = await self.call.read()
        except grpc.aio.AioRpcError as e:
            if not (self.write_broke and e.code() == grpc.StatusCode.INTERNAL):
                raise
            # The failed write's status, not the server's: what was in flight is lost, so the
            # stream counts as broken and the generation re-opens from what it committed.
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"stream broke: {e.details()}") from e
        if msg is grpc.aio.EOF:
            raise SpecsplitError(None, f"stream closed while waiting for {kind}")
        self.stats.bytes_down += msg.ByteSize()
        if msg.WhichOneof("msg") != kind:
            raise SpecsplitError(None, f"expected {kind}, got {msg.WhichOneof('msg')}")
        return getattr(msg, kind)

    async def run(self, cloud_only: bool) -> AsyncIterator[list[int]]:
        from specsplit.edge.cloud_led import cloud_led_rounds
        from specsplit.edge.lockstep import lockstep_rounds

        cfg = self.cfg
        led_asked = not cloud_only and (
            cfg.resolved_session_mode() == "cloud-led" or (cfg.may_lead and self.lead_at_start)
        )
        self.call = self.stub.Generate(metadata=self.metadata)
        start = pb.Start(
            protocol_version=PROTOCOL_VERSION,
            model=cfg.model,
            prompt_ids=self.committed,
            sampling=sampling_params(cfg.sampling, self.seed, self.max_new_tokens, cfg.stop_ids),
            verification=MODE_TO_PB.get(cfg.verification, 0),
            cloud_only=cloud_only,
            cloud_led=led_asked,
        )
        t_sent = time.perf_counter()
        await self.send(pb.ClientMessage(start=start))
        # Draft the first block (the draft's own prefill included) while the cloud prefills;
        # a sampled draft needs the seed first, which Started brings when we sent none.
        early = not (cloud_only or led_asked) and (self.seed is not None or cfg.sampling.greedy)
        k_first = min(cfg.draft_tokens, self.max_new_tokens - 1)
        early_draft = Worker(self._draft_stoppable, k_first) if early else None
        try:
            started = await self.recv("started")
            # The round trip (and, on a cold channel, its setup): the server reports its part.
            rtt_ms = (time.perf_counter() - t_sent) * 1e3 - started.setup_ms
            self.stats.start_rtt_ms = max(0.0, rtt_ms)
            if started.accepts_lead:  # a server that serves auto: the link, for the next Start
                self.link = Link(self.stats.start_rtt_ms, started.step_ms)
            self.reached = True
            self.seed = self.stats.seed = started.seed
            cloud_led = led_asked and started.cloud_led  # an older server runs lock-step
            self.stats.led_at_start = cloud_led and cfg.session_mode == "auto"
            lockstep = not (cloud_only or cloud_led)
            first = await early_draft.result() if early_draft is not None else None
            if lockstep and first is None:
                first = await self.draft_off_loop(min(cfg.draft_tokens, started.max_new_tokens - 1))
        finally:
            if early_draft is not None:  # the drafter must be idle before anyone else uses it
                await early_draft.join()
        if not cloud_only:
            self._check_pair(started.model)
        if cloud_only:
            rounds = self._cloud_only()
        elif cloud_led:
            rounds = cloud_led_rounds(self, started)
        else:
            rounds = lockstep_rounds(self, started, first)
        async for chunk in rounds:
            yield chunk
        finished = await self.recv("finished")
        self.stats.target_forward_passes += finished.target_forward_passes
        self.stats.drafts_dropped += finished.drafts_dropped
        self.stats.finish = reason_name(finished.reason)
        await self.call.done_writing()

    def _check_pair(self, model: pb.ModelInfo) -> None:
        if self.drafter.vocab_size > model.vocab_size:
            raise SpecsplitError(
                None,
                f"draft vocabulary ({self.drafter.vocab_size}) does not fit the target "
                f"{model.name!r} ({model.vocab_size}): not a matching draft model",
            )

    def draft(
        self, k: int, prefix: list[int] | None = None, drafter: Drafter | None = None
    ) -> tuple[Block, float]:
        """A block of k tokens after ``prefix`` (default: the committed prefix), and the time it
        took (ms). The generator depends only on the prefix length, so a block drafted ahead for
        a guessed prefix equals the one drafted after the verdict confirms it."""
        cfg = self.cfg
        seq = self.committed if prefix is None else prefix
        t0 = time.perf_counter()
        block = propose(
            drafter or self.drafter, seq, k, cfg.sampling, self.noise, cfg.q_entries, cfg.q_levels
        )
        return block, (time.perf_counter() - t0) * 1e3

    async def draft_off_loop(self, k: int) -> tuple[Block, float]:
        """``draft(k)`` in a worker thread: the event loop, and with it the streams of every
        other generation in this process (`specsplit-edge serve`'s), goes on meanwhile."""
        worker = Worker(self._draft_stoppable, k)
        try:
            return await worker.result()
        finally:
            await worker.join()

    def _draft_stoppable(self, k: int, stop: threading.Event) -> tuple[Block, float]:
        return self.draft(k, None, self._stoppable(stop))

    def _stoppable(self, stop: threading.Event) -> Drafter:
        """The drafter for a worker thread: each forward pass first checks ``stop``. A drafter
        with its own propose (the load benchmark's replay) does no forward passes."""
        own = hasattr(self.drafter, "propose")
        return self.drafter if own else Stoppable(self.drafter, stop)

    def draft_ahead(self, seq: list[int], k: int, stop: threading.Event) -> tuple[int, Block]:
        """Runs in a worker thread while the verdict on ``seq``'s drafts is in flight: guesses
        the bonus as the draft's top token and drafts the block after it."""
        drafter = self._stoppable(stop)
        cfg = self.cfg
        guess = guess_next(drafter, seq, cfg.sampling, self.noise, cfg.q_entries, cfg.q_levels)
        return guess, self.draft(k, [*seq, guess], drafter)[0]

    @property
    def noise(self) -> SharedNoise | None:
        """The session's shared numbers (None when greedy); needs the seed, which Started
        brings when the request sent none."""
        if self.cfg.sampling.greedy:
            return None
        if self._noise is None or self._noise.seed != self.seed:
            assert self.seed is not None, "a sampled draft needs the session's seed"
            self._noise = SharedNoise(self.seed, self.drafter.vocab_size)
        return self._noise

    def observe(self, v: pb.Verdict, drafted: int, draft_ms: float, round_ms: float) -> None:
        """A verdict's statistics (every session mode)."""
        stats = self.stats
        stats.rounds += 1
        stats.drafted += drafted
        stats.accepted += v.accepted
        stats.observe_draft(drafted, v.accepted, v.accepted + int(v.has_token))
        stats.draft_ms.append(draft_ms)
        stats.round_ms.append(round_ms)
        stats.verify_ms.append(v.timings.verify_ms)
        stats.server_ms.append(v.timings.server_ms)
        stats.queue_ms.append(v.timings.queue_ms)
        stats.batch_sessions.append(v.timings.batch_sessions)
        stats.batch_rows.append(v.timings.batch_rows)
        if v.finished:
            self.final = reason_name(v.reason)

    async def _cloud_only(self) -> AsyncIterator[list[int]]:
        t_prev = time.perf_counter()
        while True:
            v = await self.recv("verdict")
            now = time.perf_counter()
            self.stats.rounds += 1
            self.stats.round_ms.append((now - t_prev) * 1e3)
            self.stats.verify_ms.append(v.timings.verify_ms)
            self.stats.batch_sessions.append(v.timings.batch_sessions)
            self.stats.batch_rows.append(v.timings.batch_rows)
            t_prev = now
            chunk = [v.token] if v.has_token else []
            self.committed += chunk
            if v.finished:
                self.final = reason_name(v.reason)
            yield chunk
            if v.finished:
                return

    async def close(self) -> None:
        if self.call is not None and not self.call.done():
            self.call.cancel()
