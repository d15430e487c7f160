"""Async client API for applications: the draft -> send -> commit loop of DESIGN §2.

    async with SplitClient("127.0.0.1:50051", drafter) as client:
        gen = client.generate(prompt_ids, GenerationConfig(max_new_tokens=64))
        async for tokens in gen:      # committed tokens, as each verdict arrives
            ...
        print(gen.stats.acceptance_rate)

Modes: "split" (draft on the edge, verify in the cloud), "cloud-only" (the target alone in the
cloud, streamed), "edge-only" (the draft alone, no network). gRPC errors are caught here, in one
place, and raised as ``SpecsplitError`` with the status code.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc
import numpy as np

from specsplit.edge.channel import open_channel
from specsplit.edge.drafting import (
    DEFAULT_Q_ENTRIES,
    Block,
    Drafter,
    generate_edge_only,
    propose,
    top_token,
)
from specsplit.edge.generation import Generation, GenerationStats  # noqa: F401 (re-export)
from specsplit.edge.retry import DEFAULT_WINDOW_S, Backoff
from specsplit.shared.acceptance import Mode
from specsplit.shared.protocol import (
    MODE_TO_PB,
    PROTOCOL_VERSION,
    pb,
    pb_grpc,
    sampling_params,
    sparse_to_pb,
)
from specsplit.shared.sampling import Q_LEVELS, SamplingConfig
from specsplit.shared.seeding import round_rng

MODES = ("split", "cloud-only", "edge-only")
T = TypeVar("T")


class SpecsplitError(RuntimeError):
    def __init__(self, code: grpc.StatusCode | None, details: str):
        super().__init__(f"{code.name if code else 'ERROR'}: {details}")
        self.code = code
        self.details = details


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 128
    sampling: SamplingConfig = SamplingConfig()
    # None: the server picks a seed per request (edge-only: the edge does) and reports it in
    # stats.seed; give one to reproduce a run.
    seed: int | None = None
    draft_tokens: int = 4  # k
    # Draft at most the cloud's per-verdict hint (it shortens blocks when the cloud is
    # compute-bound). False keeps k fixed: seeded sampled runs then repeat exactly whatever the
    # cloud's load (the output's distribution is the target's either way).
    follow_hint: bool = True
    verification: Mode | None = None  # None: greedy at temperature 0, else rejection
    stop_ids: tuple[int, ...] = ()
    q_entries: int = DEFAULT_Q_ENTRIES
    # The draft samples from q quantised to this many steps and sends one byte per entry
    # (SparseDistribution.counts); 0 samples from and sends float q (4 bytes per entry).
    q_levels: int = Q_LEVELS
    model: str = ""  # target model name; "" = the server's default
    # After UNAVAILABLE, re-open from the committed sequence with backoff for up to this long
    # per outage (edge/retry.py); never once the final verdict came.
    retry_window_s: float = DEFAULT_WINDOW_S
    # While a verdict is in flight, draft the next block for "all accepted, bonus = the draft's
    # top token"; used when the verdict matches (DESIGN §4). Output is the same either way.
    draft_ahead: bool = True


class SplitClient:
    """A connection to a gateway. TLS when ``tls`` is true or any tls_* file is given;
    ``token`` is sent as ``authorization: Bearer <token>`` on every call."""

    def __init__(
        self,
        address: str | None,
        drafter: Drafter | None = None,
        *,
        tls: bool = False,
        tls_ca: str | Path | None = None,
        tls_cert: str | Path | None = None,
        tls_key: str | Path | None = None,
        token: str | None = None,
    ):
        self.address = address
        self.drafter = drafter
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._channel = None
        if address:
            tls_files = dict(tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key)
            self._channel = open_channel(address, tls=tls, **tls_files)
        self._stub = pb_grpc.SpeculativeDecodingStub(self._channel) if self._channel else None

    async def __aenter__(self) -> SplitClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()

    def generate(
        self, prompt_ids: Sequence[int], cfg: GenerationConfig, mode: str = "split"
    ) -> Generation:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not prompt_ids:
            raise ValueError("prompt_ids must hold at least one token")
        if mode != "cloud-only" and self.drafter is None:
            raise ValueError(f"mode {mode} needs a drafter")
        if mode != "edge-only" and self._stub is None:
            raise ValueError(f"mode {mode} needs a server address")
        if mode != "cloud-only" and max(prompt_ids) >= self.drafter.vocab_size:
            raise ValueError(
                f"prompt token id {max(prompt_ids)} outside the draft's vocabulary "
                f"[0, {self.drafter.vocab_size})"
            )
        stats = GenerationStats(mode=mode)
        if mode == "edge-only":
            return Generation(self._edge_only(list(prompt_ids), cfg, stats), stats)
        return Generation(self._with_retries(list(prompt_ids), cfg, stats, mode), stats)

    async def _edge_only(self, prompt, cfg, stats) -> AsyncIterator[list[int]]:
        stats.seed = secrets.randbits(63) if cfg.seed is None else cfg.seed
        rng = round_rng(stats.seed, "edge-only", len(prompt))
        tokens = generate_edge_only(
            self.drafter, prompt, cfg.sampling, cfg.max_new_tokens, rng, frozenset(cfg.stop_ids)
        )
        last = None
        for last in tokens:
            yield [last]
            await asyncio.sleep(0)  # let other tasks run between tokens
        # Same reasons as the cloud reports, checked in the same order.
        if last in self.drafter.eos_token_ids:
            stats.finish = "EOS"
        elif last in cfg.stop_ids:
            stats.finish = "STOP_TOKEN"
        else:
            stats.finish = "LENGTH"

    async def _with_retries(self, prompt, cfg, stats, mode) -> AsyncIterator[list[int]]:
        """Runs the session; after UNAVAILABLE re-opens with the committed sequence as prompt."""
        committed = list(prompt)
        backoff = Backoff(cfg.retry_window_s)
        while True:
            remaining = cfg.max_new_tokens - (len(committed) - len(prompt))
            # A re-open sends the seed the first Started reported: sampling resumes unchanged.
            session = _Session(
                self._stub, self.drafter, cfg, stats, committed, remaining, stats.seed
            )
            session.metadata = self.metadata
            try:
                async for chunk in session.run(cloud_only=mode == "cloud-only"):
                    committed += chunk
                    backoff.progress()
                    yield chunk
                return
            except grpc.aio.AioRpcError as e:
                if session.final:  # everything arrived; only the goodbye was lost
                    stats.finish = stats.finish or session.final
                    return
                pause = backoff.next_pause() if e.code() == grpc.StatusCode.UNAVAILABLE else None
                if pause is None:
                    raise SpecsplitError(e.code(), e.details()) from None
                stats.retries += 1
                await asyncio.sleep(pause)
            finally:
                await session.close()


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def _reason(reason: int) -> str:
    return pb.FinishReason.Name(reason).removeprefix("FINISH_REASON_")


class _Stopped(Exception):
    """The draft-ahead worker was told to stop (its generation ended)."""


class _Stoppable:
    """The drafter as the draft-ahead worker sees it: each forward pass first checks ``stop``."""

    def __init__(self, drafter: Drafter, stop: threading.Event):
        self._drafter, self._stop = drafter, stop
        self.vocab_size, self.eos_token_ids = drafter.vocab_size, drafter.eos_token_ids

    @property
    def cached(self) -> list[int]:
        return self._drafter.cached

    def truncate(self, n: int) -> None:
        self._drafter.truncate(n)

    def forward(self, tokens: Sequence[int]) -> np.ndarray:
        if self._stop.is_set():
            raise _Stopped
        return self._drafter.forward(tokens)


class _Worker:
    """``fn(*args, stop)`` in a thread. Its future is only ever awaited through a shield, so a
    cancelled await never detaches the thread: ``join`` stops it at the next forward pass and
    returns once it has left the drafter, even when cancelled meanwhile."""

    def __init__(self, fn: Callable[..., T], *args):
        self.stop = threading.Event()
        self.future = asyncio.get_running_loop().run_in_executor(None, fn, *args, self.stop)

    async def result(self) -> T:
        return await asyncio.shield(self.future)

    async def join(self) -> None:
        self.stop.set()
        cancelled = False
        while not self.future.done():
            try:
                await asyncio.shield(self.future)
            except asyncio.CancelledError:
                cancelled = True
            except Exception:
                pass
        if cancelled:
            raise asyncio.CancelledError


class _Session:
    """One stream: Start, then rounds until a finished Verdict."""

    def __init__(
        self, stub, drafter, cfg: GenerationConfig, stats, committed, max_new_tokens, seed
    ):
        self.stub, self.drafter, self.cfg, self.stats = stub, drafter, cfg, stats
        self.committed = list(committed)  # own copy: the caller extends its list from chunks
        self.max_new_tokens = max_new_tokens
        self.seed: int | None = cfg.seed if seed is None else seed  # Started's, once it came
        self.call = None
        self.metadata = None  # the call's metadata (the bearer token)
        self.final = ""  # the finish reason, once the final verdict came

    async def _send(self, msg: pb.ClientMessage) -> None:
        self.stats.bytes_up += msg.ByteSize()
        try:
            await self.call.write(msg)
        except asyncio.InvalidStateError:  # the server ended the call first: its status
            raise _rpc_error(await self.call.code(), await self.call.details()) from None
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.INTERNAL:
                raise
            # grpc core could not send: the connection broke (a server's own INTERNAL status
            # would have ended the call before the write). Retryable, like any lost link.
            raise _rpc_error(grpc.StatusCode.UNAVAILABLE, f"stream broke: {e.details()}") from e

    async def _recv(self, kind: str):
        msg = await self.call.read()
        if msg is grpc.aio.EOF:
            raise SpecsplitError(None, f"stream closed while waiting for {kind}")
        self.stats.bytes_down += msg.ByteSize()
        if msg.WhichOneof("msg") != kind:
            raise SpecsplitError(None, f"expected {kind}, got {msg.WhichOneof('msg')}")
        return getattr(msg, kind)

    async def run(self, cloud_only: bool) -> AsyncIterator[list[int]]:
        cfg = self.cfg
        self.call = self.stub.Generate(metadata=self.metadata)
        start = pb.Start(
            protocol_version=PROTOCOL_VERSION,
            model=cfg.model,
            prompt_ids=self.committed,
            sampling=sampling_params(cfg.sampling, self.seed, self.max_new_tokens, cfg.stop_ids),
            verification=MODE_TO_PB.get(cfg.verification, 0),
            cloud_only=cloud_only,
        )
        await self._send(pb.ClientMessage(start=start))
        # Draft the first block (the draft's own prefill included) while the cloud prefills;
        # a sampled draft needs the seed first, which Started brings when we sent none.
        early = not cloud_only and (self.seed is not None or cfg.sampling.greedy)
        first = self._draft(min(cfg.draft_tokens, self.max_new_tokens - 1)) if early else None
        started = await self._recv("started")
        self.seed = self.stats.seed = started.seed
        if not cloud_only and first is None:
            first = self._draft(min(cfg.draft_tokens, started.max_new_tokens - 1))
        if not cloud_only:
            self._check_pair(started.model)
        rounds = self._cloud_only() if cloud_only else self._split(started, first)
        async for chunk in rounds:
            yield chunk
        finished = await self._recv("finished")
        self.stats.target_forward_passes += finished.target_forward_passes
        self.stats.finish = _reason(finished.reason)
        await self.call.done_writing()

    def _check_pair(self, model: pb.ModelInfo) -> None:
        if self.drafter.vocab_size > model.vocab_size:
            raise SpecsplitError(
                None,
                f"draft vocabulary ({self.drafter.vocab_size}) does not fit the target "
                f"{model.name!r} ({model.vocab_size}): not a matching draft model",
            )

    def _draft(
        self, k: int, prefix: list[int] | None = None, drafter: Drafter | None = None
    ) -> tuple[Block, float]:
        """A block of k tokens after ``prefix`` (default: the committed prefix), and the time it
        took (ms). The generator depends only on the prefix length, so a block drafted ahead for
        a guessed prefix equals the one drafted after the verdict confirms it."""
        cfg = self.cfg
        seq = self.committed if prefix is None else prefix
        rng = None if cfg.sampling.greedy else round_rng(self.seed, "draft", len(seq))
        t0 = time.perf_counter()
        block = propose(
            drafter or self.drafter, seq, k, cfg.sampling, rng, cfg.q_entries, cfg.q_levels
        )
        return block, (time.perf_counter() - t0) * 1e3

    def _draft_ahead(self, seq: list[int], k: int, stop: threading.Event) -> tuple[int, Block]:
        """Runs in a worker thread while the verdict on ``seq``'s drafts is in flight: guesses
        the bonus as the draft's top token and drafts the block after it."""
        # A drafter with its own propose (the load benchmark's replay) does no forward passes.
        own = hasattr(self.drafter, "propose")
        drafter = self.drafter if own else _Stoppable(self.drafter, stop)
        guess = top_token(drafter, seq)
        return guess, self._draft(k, [*seq, guess], drafter)[0]

    async def _split(self, started: pb.Started, first) -> AsyncIterator[list[int]]:
        cfg, stats = self.cfg, self.stats
        k_max = min(cfg.draft_tokens, started.limits.max_draft_tokens)
        mode = started.verification
        remaining = started.max_new_tokens
        round_no = 0
        hint = k_max  # the cloud's largest wanted block, updated by every verdict
        while True:
            round_no += 1
            # A round emits up to k + 1 tokens: never draft past the length limit.
            k = max(0, min(k_max, hint, remaining - 1))
            base_len = len(self.committed)
            if first is not None:  # drafted early (prefill, or the previous verdict in flight)
                (block, draft_ms), first = first, None
                block = block.head(k)
            else:
                block, draft_ms = self._draft(k)
            t1 = time.perf_counter()
            draft = pb.Draft(round=round_no, base_len=base_len, tokens=block.tokens)
            if block.q is not None and mode == pb.VERIFICATION_MODE_REJECTION:
                draft.q.extend(sparse_to_pb(q, started.q_counts) for q in block.q)
            await self._send(pb.ClientMessage(draft=draft))
            k_next = max(0, min(k_max, hint, remaining - (k + 1) - 1))
            ahead = None
            if cfg.draft_ahead and k > 0 and k_next > 0:
                seq = [*self.committed, *block.tokens]
                ahead = _Worker(self._draft_ahead, seq, k_next)
            try:
                v = await self._recv("verdict")
                t2 = time.perf_counter()
                if ahead is not None:
                    guess, next_block = await ahead.result()
                    waited_ms = (time.perf_counter() - t2) * 1e3
                    if v.accepted == k and v.has_token and v.token == guess and not v.finished:
                        first = (next_block, waited_ms)  # only the wait is on the critical path
                        stats.ahead_hits += 1
            finally:
                if ahead is not None:  # the drafter must be idle before anyone else touches it
                    await ahead.join()
            chunk = block.tokens[: v.accepted] + ([v.token] if v.has_token else [])
            self.committed += chunk
            remaining -= len(chunk)
            stats.rounds += 1
            stats.drafted += k
            stats.accepted += v.accepted
            stats.observe_draft(k, v.accepted, len(chunk))
            stats.draft_ms.append(draft_ms)
            stats.round_ms.append((t2 - t1) * 1e3)
            stats.verify_ms.append(v.timings.verify_ms)
            stats.server_ms.append(v.timings.server_ms)
            stats.queue_ms.append(v.timings.queue_ms)
            stats.batch_sessions.append(v.timings.batch_sessions)
            stats.batch_rows.append(v.timings.batch_rows)
            if cfg.follow_hint and v.HasField("max_draft_tokens_hint"):
                hint = v.max_draft_tokens_hint
                stats.block_hint.append(hint)
            if v.finished:
                self.final = _reason(v.reason)
            yield chunk
            if v.finished:
                return

    async def _cloud_only(self) -> AsyncIterator[list[int]]:
        t_prev = time.perf_counter()
        while True:
            v = await self._recv("verdict")
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
                self.final = _reason(v.reason)
            yield chunk
            if v.finished:
                return

    async def close(self) -> None:
        if self.call is not None and not self.call.done():
            self.call.cancel()
