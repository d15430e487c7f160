"""One gRPC stream of a generation, as transport: Start, Started, the messages of its rounds
with their byte counts, each verdict's statistics, and Finished.

A ``Stream`` knows nothing of drafting or of how a mode's rounds go, and holds no loop state:
edge.rounds opens it and hands it to the loop of the session's mode (edge.lockstep,
edge.cloud_led, edge.cloud_only), which sends and receives through it; the committed sequence is
the loop's (edge.sequence.Committed), and the Stream is told its length where a message needs it
(Start's prompt, Finished's check).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import grpc

from specsplit.edge.mode_switch import Link
from specsplit.shared.protocol import (
    PROTOCOL_VERSION,
    SESSION_MODE_TO_PB,
    VERIFICATION_TO_PB,
    pb,
    sampling_params,
)
from specsplit.shared.session_mode import SessionMode

if TYPE_CHECKING:
    from specsplit.edge.generation import GenerationConfig, GenerationStats


class SpecsplitError(RuntimeError):
    def __init__(self, code: grpc.StatusCode | None, details: str):
        super().__init__(f"{code.name if code else 'ERROR'}: {details}")
        self.code = code
        self.details = details


def rpc_error(
    code: grpc.StatusCode, details: str, trailing: grpc.aio.Metadata | None = None
) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing or grpc.aio.Metadata(), details)


def reason_name(reason: int) -> str:
    return pb.FinishReason.Name(reason).removeprefix("FINISH_REASON_")


class Stream:
    """One call of Generate: Start, then rounds until a final Verdict, then Finished."""

    def __init__(
        self,
        stub,
        metadata: tuple[tuple[str, str], ...] | None,
        cfg: GenerationConfig,
        stats: GenerationStats,
        max_new_tokens: int,
        seed: int | None,
    ):
        self.stub, self.cfg, self.stats = stub, cfg, stats
        self.metadata = metadata  # the call's metadata (the bearer token)
        self.link: Link | None = None  # the round trip and step of a lead-aware Started
        self.max_new_tokens = max_new_tokens
        self.seed: int | None = cfg.seed if seed is None else seed  # Started's, once it came
        self.call = None
        self.reached = False  # its Started arrived
        self.write_broke = False  # a write failed: grpc.aio then fails every read as INTERNAL
        self.probed = False  # Start asked for a Probe: one may come before Started
        self._t_start = 0.0

    async def send(self, msg: pb.ClientMessage) -> None:
        self.stats.bytes_up += msg.ByteSize()
        try:
            await self.call.write(msg)
        except asyncio.InvalidStateError:  # the server ended the call first: its status
            # with its trailing metadata: a busy cloud's retry hint is in there (edge.retry)
            call = self.call
            trailing = await call.trailing_metadata()
            raise rpc_error(await call.code(), await call.details(), trailing) from None
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.INTERNAL:
                raise
            self.write_broke = True
            # grpc core could not send: the connection broke (a server's own INTERNAL status
            # would have ended the call before the write). Retryable, like any lost link.
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"stream broke: {e.details()}") from e

    async def recv(self, kind: str, probe: bool = False):
        """The next message, which must be a ``kind``; with ``probe``, one Probe may come first,
        answered with an Echo at once."""
        while True:
            msg = await self._read(kind)
            got = msg.WhichOneof("msg")
            if got == "probe" and probe:
                probe = False  # one Probe per stream
                await self.send(pb.ClientMessage(echo=pb.Echo()))
                continue
            if got != kind:
                raise SpecsplitError(None, f"expected {kind}, got {got}")
            return getattr(msg, kind)

    async def _read(self, kind: str) -> pb.ServerMessage:
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
        return msg

    async def start(
        self,
        prompt: Sequence[int],
        mode: SessionMode,
        draft_tokenizer: str | None = None,
        follows_lead: bool = False,
        first_draft: bool = False,
    ) -> None:
        """Opens the call and sends Start with ``prompt`` (after an outage, the whole committed
        sequence), asking for session mode ``mode``; a drafting client
        names its draft's tokenizer (the cloud refuses a pair that does not share one), and one
        whose lock-step rounds can go on cloud-led says it follows the cloud's lead, and asks
        for the Probe that lets the cloud time the round trip during prefill (Start.probe):
        ``started`` echoes it. ``first_draft``: a Draft follows before Started (Start.first_draft,
        edge.rounds)."""
        cfg = self.cfg
        self.call = self.stub.Generate(metadata=self.metadata)
        start = pb.Start(
            protocol_version=PROTOCOL_VERSION,
            model=cfg.model,
            prompt_ids=prompt,
            sampling=sampling_params(cfg.sampling, self.seed, self.max_new_tokens, cfg.stop_ids),
            verification=VERIFICATION_TO_PB.get(cfg.verification, 0),
            draft_tokenizer=draft_tokenizer or "",
            follows_lead=follows_lead,
            probe=follows_lead,
            session_mode=SESSION_MODE_TO_PB[mode],
            first_draft=first_draft,
        )
        self.probed = follows_lead
        self._t_start = time.perf_counter()
        await self.send(pb.ClientMessage(start=start))

    async def started(self) -> pb.Started:
        """Started; a Probe before it (Start.probe) is answered with an Echo the moment it
        is read: the cloud times the round trip with it while the target prefills."""
        started = await self.recv("started", probe=self.probed)
        # The round trip (and, on a cold channel, its setup): the server reports its part.
        rtt_ms = max(0.0, (time.perf_counter() - self._t_start) * 1e3 - started.setup_ms)
        self.stats.observe_started(rtt_ms, started.seed)
        if started.accepts_lead:  # a server that serves auto: the link, for the next Start
            self.link = Link(rtt_ms, started.step_ms)
        self.reached = True
        self.seed = started.seed
        return started

    async def finish(self, committed_len: int) -> None:
        """After the final verdict: Finished, and the client's half of the call closed;
        ``committed_len``: what the edge committed, which Finished must repeat."""
        finished = await self.recv("finished")
        if finished.committed_len != committed_len:
            # Every token was already handed on, each with a Verdict that agreed: a re-open
            # would extend a finished generation, so this one fails instead (not retried).
            raise SpecsplitError(
                grpc.StatusCode.INTERNAL,
                f"the cloud's Finished says committed_len {finished.committed_len}, the edge "
                f"committed {committed_len} (after its final Verdict agreed)",
            )
        self.stats.observe_finished(
            reason_name(finished.reason), finished.target_forward_passes, finished.drafts_dropped
        )
        await self.call.done_writing()

    async def close(self) -> None:
        if self.call is not None and not self.call.done():
            self.call.cancel()
