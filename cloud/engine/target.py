"""The target model's side of a round, for many sessions at once: prefill, verify, roll back.

Plain Python + torch, so it is unit-testable without Triton; ``model_repository/target/1/model.py``
is a thin shell over this. Knows nothing of gRPC or of stop conditions (the gateway owns those).

``TargetModel.step`` takes every request of one Triton ``execute()`` (opens, verification blocks
of any k, cloud-only steps with k = 0, ends) and serves all verification rows in ONE forward pass
(``cloud.engine.ragged``). Prompts are prefilled across passes: each pass carries at most
``PREFILL_CHUNK`` prompt rows, shared evenly among the clients whose prompts wait (``Open.client``),
and fewer beside verification rows when the cost curve says prompt rows would make the pass more
than ``PREFILL_SLOWDOWN`` times slower. So one long prompt never holds other sessions' steps for
its whole prefill, nor takes every shared pass's rows while another client's prompt waits; an
Open is answered (``step``'s ``finished``) once its whole prompt is in its slot. ``run`` serves a
batch to completion (tests, tools).

Memory: the KV ledger (``cloud.engine.kv_ledger``, ``TargetModel.kv_ledger``) says how many bytes
of KV slots the target may hold and each client's share of them; an Open or a step past either
is refused with its KVCapacityExceeded, the pass served without it. The session behind an
out-of-memory error in a pass is refused the same way and the pass run again without it
(``_without_culprit``). A session whose Open set a lease (``Open.lease_s``: its gateway's longest
silence) is evicted once idle for longer, so a gateway that died does not leave its sessions' KV
held for the full idle limit.

Cache invariant: once its Open is answered, after every call, a session's KV slot holds exactly
``committed[:-1]``, i.e. ``cache_len == committed_len - 1``. A verify request therefore feeds the
last committed token followed by the k drafts: k + 1 positions whose logits are p_1..p_{k+1}.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import numpy as np
import torch

from specsplit.cloud.capacity import Acceptance, CostModel, max_draft_tokens_hint
from specsplit.cloud.engine.kv_ledger import KVCapacityExceeded, KVLedger, check_per_client_share
from specsplit.cloud.engine.kv_slots import Slot
from specsplit.cloud.engine.precision import check_weights, pick_device
from specsplit.cloud.engine.ragged import RaggedForward, Segment
from specsplit.cloud.kv_growth import KV_PER_CLIENT_SHARE, MAX_DRAFT_TOKENS
from specsplit.shared.acceptance import (
    RoundResult,
    VerificationRule,
    verify_greedy,
    verify_rejection,
    verify_token_only,
)
from specsplit.shared.coupling import SharedNoise
from specsplit.shared.sampling import SamplingConfig, SparseDist, logits_to_probs
from specsplit.shared.seeding import round_rng
from specsplit.shared.tokenizer_fingerprint import token_count

log = logging.getLogger(__name__)


class SessionNotFound(KeyError):
    """The session is unknown here (never started, ended, evicted, or the server restarted)."""


@dataclass(frozen=True)
class SessionParams:
    sampling: SamplingConfig
    verification: VerificationRule
    seed: int = 0
    speculative: bool = True  # False: a cloud-only session (k = 0 every step)


@dataclass(frozen=True)
class Verified:
    result: RoundResult
    verify_ms: float  # the forward pass that served it + its acceptance


@dataclass
class _Sequence:
    params: SessionParams
    slot: Slot
    last_used: float = field(default_factory=time.monotonic)
    lease_s: float = 0.0  # evicted once idle this long (0: the engine's idle limit alone)
    client: int = 0  # whose KV share its slot counts against (0: none)

    @property
    def cache_len(self) -> int:
        return self.slot.length


@dataclass(frozen=True)
class Open:
    """Opens (or re-opens) session ``sid`` and prefills ``prompt[:-1]``; ``client`` (0: the
    session alone) is whose share of prefill rows per pass the prompt's rows count against, and
    whose share of the KV capacity the session's slot counts against; ``lease_s`` (0: none)
    how long the session may stay idle before it is evicted."""

    sid: int
    prompt: Sequence[int]
    params: SessionParams
    client: int = 0
    lease_s: float = 0.0  # evict after this long idle (0: the engine's idle limit)


@dataclass(frozen=True)
class Verify:
    """Verifies ``tokens`` = [last committed token, d_1..d_k] at ``base_len`` (k = 0: one
    cloud-only step); ``end`` frees the session afterwards."""

    sid: int
    base_len: int
    tokens: Sequence[int]
    q: Sequence[SparseDist] | None = None  # [k] for REJECTION
    end: bool = False


@dataclass(frozen=True)
class Close:
    sid: int


Request = Open | Verify | Close


@dataclass(frozen=True)
class PassInfo:
    """The forward pass that served a batch: what Triton formed, and the hint it led to."""

    rows: int = 0
    sessions: int = 0
    ms: float = 0.0
    max_draft_tokens_hint: int = 0


PREFILL_CHUNK = 256  # prefill tokens per forward pass: bounds activation memory for long prompts
# Beside verification rows, prompt rows may make a pass at most this many times slower (by the
# cost curve; issue 39's bound on a client's time to first token beside another's long prompt)...
PREFILL_SLOWDOWN = 2.0
MIN_PREFILL_ROWS = 16  # ...but never fewer than this per pass: every prompt keeps moving


class _Prefilling:
    """``step``'s outcome for an Open whose prompt is not all in its slot yet: its outcome comes
    in a later ``finished``."""

    def __repr__(self) -> str:
        return "PREFILLING"


PREFILLING = _Prefilling()


@dataclass
class _Prefill:
    """An opened session's prompt rows still to run, and whose share they count against."""

    session: _Sequence
    todo: list[int]
    client: int


def _water_fill(wants: list[int], budget: int) -> list[int]:
    """``budget`` split evenly among ``wants``: each gets min(its want, an even part of what
    the smaller wants left), so one that needs less than its part leaves the rest to others."""
    out = [0] * len(wants)
    left = budget
    order = sorted(range(len(wants)), key=wants.__getitem__)
    for n, i in enumerate(order):
        out[i] = min(wants[i], -(-left // (len(order) - n)))
        left -= out[i]
    return out


def _out_of_memory(e: Exception) -> bool:
    """An allocation the device could not serve (torch's OutOfMemoryError is a RuntimeError)."""
    return isinstance(e, MemoryError) or "out of memory" in str(e).lower()


def _load(model_dir, device, weights: str, dtype: str, packed_linear: bool):
    """(forward, format, float dtype) for the model at ``model_dir``
    (``cloud.engine.precision``)."""
    from transformers import AutoModelForCausalLM

    from specsplit.cloud.engine.precision import choose

    check_weights(weights)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").eval()
    gguf_path = None
    if weights in ("auto", "gguf") and device.type == "cpu":
        from specsplit.cloud.engine.gguf_weights import mlp_formats, source_gguf

        gguf_path = source_gguf(model_dir)
        if weights == "auto" and gguf_path and mlp_formats(gguf_path, model.config) is None:
            gguf_path = None  # its MLP is in no kernel format: auto chooses as for a float copy

    @cache
    def on_4bit_grids() -> bool:  # asked only where the kernels can read the model's widths
        from specsplit.cloud.engine.quantized import four_bit_source, projections

        return four_bit_source(projections(model))

    fmt, torch_dtype = choose(weights, dtype, device, model.config, on_4bit_grids, gguf_path)
    if fmt != "float":
        from specsplit.cloud.engine import quant_cache
        from specsplit.cloud.engine.kernel_forward import KernelForward

        four_bit = fmt == "int4" and on_4bit_grids()
        cache_key = quant_cache.key(model_dir, fmt, four_bit, gguf_path if fmt == "gguf" else None)
        forward = KernelForward(model, fmt, four_bit, cache_key, gguf_path)
        return forward, fmt, torch_dtype
    model = model.to(device=device, dtype=torch_dtype)
    if device.type == "cpu" and torch_dtype == torch.float32 and packed_linear:
        from specsplit.cloud.engine.packed_linear import pack_linears

        log.info("packed %d linear layers for oneDNN", pack_linears(model))
    return RaggedForward(model), fmt, torch_dtype


class TargetModel:
    """A causal LM serving many sessions, each with its own KV slot, batched per ``run``."""

    def __init__(
        self,
        model_dir: str | Path,
        device: str | None = None,
        threads: int | None = None,
        dtype: str = "auto",
        packed_linear: bool = True,
        calibrate: bool = True,
        weights: str = "auto",
        kv_capacity: int | None = None,  # bytes of KV slots it may hold; None: its device's
        kv_per_client_share: float = KV_PER_CLIENT_SHARE,  # of kv_capacity, per client; 0: off
    ):
        check_per_client_share(kv_per_client_share)  # before the load: bad config fails fast
        if threads:
            torch.set_num_threads(threads)
        self.device = pick_device(device)
        self.forward, self.weights, dtype = _load(
            model_dir, self.device, weights, dtype, packed_linear
        )
        self.config = self.forward.config
        self.model = getattr(self.forward, "model", None)  # the torch model (float path only)
        self.vocab_size = int(self.config.vocab_size)
        # Ids past the tokenizer's are a model's padding rows (no text maps to them): the
        # target never emits one, so a draft padded differently never meets one either.
        tokenizer = Path(model_dir) / "tokenizer.json"
        self.token_count = token_count(tokenizer) if tokenizer.exists() else self.vocab_size
        self.sessions: dict[int, _Sequence] = {}
        self.prefills: dict[int, _Prefill] = {}  # opened sessions whose prompt is still running
        self._finished: list[tuple[int, object]] = []  # Opens answered since the last step
        self.forward_passes = 0
        self.cost = CostModel()
        self.acceptance = Acceptance()
        self.last_pass = PassInfo(max_draft_tokens_hint=MAX_DRAFT_TOKENS)
        if calibrate:
            self.cost.calibrate(self._timed_pass)
            log.info(
                "forward cost by rows (ms): %s", {r: round(m, 1) for r, m in self.cost.ms.items()}
            )
        self.kv_ledger = KVLedger(
            self.forward.slots, self.sessions, kv_capacity, kv_per_client_share
        )
        log.info(
            "target %s on %s (%s weights, %s), vocab %d",
            model_dir,
            self.device,
            self.weights,
            dtype,
            self.vocab_size,
        )

    # -- single-request conveniences (tests, tools) -------------------------------------------

    def start(self, sid: int, prompt: Sequence[int], params: SessionParams) -> None:
        self._one(Open(sid, prompt, params))

    def verify(self, sid, base_len, tokens, q=None) -> RoundResult:
        return self._one(Verify(sid, base_len, tokens, q)).result

    def end(self, sid: int) -> bool:
        if self.prefills.pop(sid, None) is not None:  # its Open is answered: the session is gone
            self._finished.append((sid, SessionNotFound(f"session {sid} ended during its prefill")))
        session = self.sessions.pop(sid, None)
        if session is not None:
            self.forward.slots.free(sid)
        return session is not None

    def _one(self, request: Request):
        [outcome], _ = self.run([request])
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    # -- the batch ------------------------------------------------------------------------------

    def run(self, requests: Sequence[Request]) -> tuple[list, PassInfo]:
        """Serves one batch to completion, every prompt prefilled; returns an outcome per
        request (Verified for Verify, None for Open/Close, or the exception that request
        failed with) and the first pass's info."""
        outcomes, info, _ = self._serve(requests, drain=True)
        finished = self.take_finished()
        for sid, outcome in finished:  # in order: a sid opened twice is answered in turn
            i = next(
                i for i, o in enumerate(outcomes) if o is PREFILLING and requests[i].sid == sid
            )
            outcomes[i] = outcome
        return outcomes, info

    def step(self, requests: Sequence[Request]) -> tuple[list, PassInfo, list[tuple[int, object]]]:
        """Serves one batch with one forward pass (one per group of a sid that appears twice),
        which also carries a share of the prompts still waiting. Returns an outcome per request
        (PREFILLING for an Open), the first pass's info, and (sid, outcome) in order for every
        Open, of this batch or an earlier one, whose prefill ended (None) or failed."""
        outcomes, info, _ = self._serve(requests, drain=False)
        return outcomes, info, self.take_finished()

    def take_finished(self) -> list[tuple[int, object]]:
        finished, self._finished = self._finished, []
        return finished

    def _serve(self, requests: Sequence[Request], drain: bool) -> tuple[list, PassInfo, None]:
        """A session appearing twice is served in order, in a second group."""
        outcomes: list = []
        info: PassInfo | None = None
        group: list[Request] = []
        for request in [*requests, None]:
            if request is None or any(r.sid == request.sid for r in group):
                out, group_info = self._run_group(group, drain)
                outcomes += out
                info = info or group_info
                group = []
            if request is not None:
                group.append(request)
        return outcomes, info or self.last_pass, None

    def _run_group(self, requests: Sequence[Request], drain: bool) -> tuple[list, PassInfo | None]:
        outcomes: list = [None] * len(requests)
        verifies: list[tuple[int, Verify, _Sequence]] = []
        for i, req in enumerate(requests):
            try:
                if isinstance(req, Close):
                    self.end(req.sid)
                elif isinstance(req, Open):
                    self._open(req)
                    outcomes[i] = PREFILLING
                else:
                    verifies.append((i, req, self._checked(req)))
            except Exception as e:
                outcomes[i] = e
        info = self._pass(verifies, outcomes)
        while drain and self.prefills:
            self._pass([], outcomes)
        return outcomes, info

    def _pass(self, verifies, outcomes: list) -> PassInfo | None:
        """One forward pass: ``verifies`` and the prompt rows ``_plan_prefill`` grants. A step
        whose slot would grow past the KV capacity is refused; after an out-of-memory error the
        pass runs again without the session that caused it (``_without_culprit``)."""
        verifies = self._within_capacity(verifies, outcomes)
        verify_rows = sum(len(req.tokens) for _, req, _ in verifies)
        chunks = self._plan_prefill(verify_rows)
        while True:
            segments = [Segment(s.slot, req.tokens, want_logits=True) for _, req, s in verifies]
            segments += [Segment(p.session.slot, p.todo[:n], False) for _, p, n in chunks]
            if not segments:
                return None
            t0 = time.perf_counter()
            try:
                logits = self.forward(segments)  # on an exception no slot's length changes
                break
            except Exception as e:
                if not _out_of_memory(e):
                    log.warning("forward pass failed: %s", e)
                    for i, _, _ in verifies:
                        outcomes[i] = e
                    for sid, _, _ in chunks:
                        self._fail_prefill(sid, e)
                    return None
                verifies, chunks = self._without_culprit(verifies, chunks, outcomes, e)
        ms = (time.perf_counter() - t0) * 1e3
        self.forward_passes += 1
        now = time.monotonic()
        for sid, p, n in chunks:
            del p.todo[:n]
            p.session.last_used = now
            if not p.todo:
                del self.prefills[sid]
                self._finished.append((sid, None))
        if verifies:
            info = self._after_pass(segments, verifies, ms)
        else:  # prompt rows only: the hint stands, as the next step's pass will not have them
            rows = sum(len(s.tokens) for s in segments)
            info = PassInfo(rows, len(segments), ms, self.last_pass.max_draft_tokens_hint)
        for (i, req, session), lg in zip(verifies, logits, strict=False):
            outcomes[i] = self._finish(req, session, lg, ms)
        return info

    def _within_capacity(self, verifies, outcomes: list) -> list:
        """``verifies`` less those whose slot the KV ledger refuses to grow
        (``KVLedger.step_refusals``: the refusal is their outcome, the session as it was);
        prompts reserved their whole slot at their Open."""
        steps = [(req.sid, s, s.cache_len + len(req.tokens)) for _, req, s in verifies]
        kept = []
        for (i, req, s), refusal in zip(verifies, self.kv_ledger.step_refusals(steps), strict=True):
            if refusal is None:
                kept.append((i, req, s))
            else:
                outcomes[i] = refusal
        return kept

    def _without_culprit(self, verifies, chunks, outcomes: list, e: Exception):
        """After an out-of-memory pass: the segment with the most rows (the largest
        activations; a slot that had to grow first, as its allocation is what failed) is
        refused with KVCapacityExceeded, the rest go again."""
        log.warning("out of memory in a pass of %d segments: %s", len(verifies) + len(chunks), e)
        slots = self.forward.slots
        sized = [
            (slots.growth_bytes(s.slot, s.cache_len + len(r.tokens)), len(r.tokens), i, r.sid)
            for i, r, s in verifies
        ] + [(0, n, None, sid) for sid, _, n in chunks]
        _, rows, index, sid = max(sized, key=lambda x: x[:2])
        full = KVCapacityExceeded(
            f"session {sid}: out of memory in a pass with {rows} of its rows; retry when "
            "sessions end"
        )
        if index is None:
            self._fail_prefill(sid, full)
            return verifies, [c for c in chunks if c[0] != sid]
        outcomes[index] = full
        return [v for v in verifies if v[0] != index], chunks

    def _prefill_budget(self, verify_rows: int) -> int:
        """Prompt rows this pass may carry: PREFILL_CHUNK, or beside ``verify_rows`` the most
        (halving, down to MIN_PREFILL_ROWS) the cost curve says keep the pass within
        PREFILL_SLOWDOWN of the verification rows' own."""
        if not verify_rows or not self.cost.ms:
            return PREFILL_CHUNK
        limit = PREFILL_SLOWDOWN * self.cost.cost(verify_rows)
        rows = PREFILL_CHUNK
        while rows > MIN_PREFILL_ROWS and self.cost.cost(verify_rows + rows) > limit:
            rows //= 2
        return max(rows, MIN_PREFILL_ROWS)

    def _plan_prefill(self, verify_rows: int) -> list[tuple[int, _Prefill, int]]:
        """(sid, prefill, rows) for this pass: the budget beside ``verify_rows``
        (``_prefill_budget``) split evenly among the clients with prompts waiting, and each
        client's part evenly among its prompts (``_water_fill``). A client that needs less than
        its part gets all it needs, and its rows then count as work the others' prompt rows must
        not slow down (PREFILL_SLOWDOWN): a short prompt beside a long one is served in one pass
        that costs about what it would alone."""
        by_client: dict[int, list[tuple[int, _Prefill]]] = {}
        for sid, p in self.prefills.items():
            by_client.setdefault(p.client or -1 - sid, []).append((sid, p))
        clients = list(by_client)
        want = [sum(len(p.todo) for _, p in by_client[c]) for c in clients]
        rows = _water_fill(want, self._prefill_budget(verify_rows))
        partial = [i for i, (r, w) in enumerate(zip(rows, want, strict=True)) if r < w]
        if partial and len(partial) < len(clients):  # the long prompts yield to the short ones
            protected = sum(r for i, r in enumerate(rows) if i not in partial)
            cap = _water_fill(
                [rows[i] for i in partial], self._prefill_budget(verify_rows + protected)
            )
            for i, r in zip(partial, cap, strict=True):
                rows[i] = r
        chunks = []
        for client, give in zip(clients, rows, strict=True):
            prompts = by_client[client]
            takes = _water_fill([len(p.todo) for _, p in prompts], give)
            chunks += [(sid, p, n) for (sid, p), n in zip(prompts, takes, strict=True) if n]
        return chunks

    def _fail_prefill(self, sid: int, error: Exception) -> None:
        del self.prefills[sid]
        self._finished.append((sid, error))
        self.end(sid)

    def _after_pass(self, segments, verifies, ms: float) -> PassInfo:
        rows = sum(len(s.tokens) for s in segments)
        if verifies:
            self.cost.observe(rows, ms)
        spec = [req for _, req, s in verifies if s.params.speculative]
        spec_rows = sum(len(req.tokens) for req in spec)
        if spec and spec_rows == len(spec) and self.last_pass.max_draft_tokens_hint == 0:
            self.acceptance.idle()  # no drafts because the hint forbade them (Acceptance.idle)
        other = [req for _, req, s in verifies if not s.params.speculative]
        # The next pass's other rows: cloud-only steps recur, prefills do not. Counted as fixed
        # rows, a prefill made drafts look nearly free beside it and the pass's hint jumped
        # (45 prompt rows beside 8 sessions: 7 instead of 1, on a compute-bound CPU target).
        hint = max_draft_tokens_hint(
            self.cost,
            spec_sessions=len(spec),
            other_rows=sum(len(req.tokens) for req in other),
            other_tokens=len(other),
            alpha=self.acceptance.rate,
            max_draft_tokens=MAX_DRAFT_TOKENS,
        )
        self.last_pass = PassInfo(rows, len(segments), ms, hint)
        return self.last_pass

    def _finish(self, req: Verify, session: _Sequence, logits, pass_ms: float):
        t0 = time.perf_counter()
        drafts = list(req.tokens[1:])
        try:
            result = self._accept(session.params, req.base_len, logits, drafts, req.q)
        except Exception as e:
            session.slot.length = req.base_len - 1  # a failed round leaves the session as it was
            return e
        # Keep committed[:-1]: the old cache, the last committed token and the accepted drafts.
        session.slot.length = req.base_len + result.accepted
        session.last_used = time.monotonic()
        if session.params.speculative and drafts:
            self.acceptance.observe(result.accepted, len(drafts))
        if req.end:
            self.end(req.sid)
        return Verified(result, pass_ms + (time.perf_counter() - t0) * 1e3)

    def _open(self, req: Open) -> None:
        if not req.prompt:
            raise ValueError("prompt must hold at least one token")
        self._check_ids(req.prompt)
        self.end(req.sid)
        # The prompt's whole slot, now; after end(): a re-Open's old slot is freed.
        need = self.kv_ledger.check_open(req.sid, req.client, len(req.prompt) - 1)
        slots = self.forward.slots
        try:
            slot = slots.open(req.sid)
            slots.reserve(slot, len(req.prompt) - 1)
        except Exception as e:
            slots.free(req.sid)
            if _out_of_memory(e):
                raise self.kv_ledger.full(req.sid, need, "its prompt") from e
            raise
        lease_s = max(req.lease_s, 0.0)
        session = _Sequence(params=req.params, slot=slot, lease_s=lease_s, client=req.client)
        self.sessions[req.sid] = session
        todo = list(req.prompt[:-1])
        if todo:
            self.prefills[req.sid] = _Prefill(session, todo, req.client)
        else:
            self._finished.append((req.sid, None))

    def _checked(self, req: Verify) -> _Sequence:
        session = self._get(req.sid)
        if req.sid in self.prefills:
            raise ValueError(f"session {req.sid} is still prefilling its prompt")
        if req.base_len != session.cache_len + 1:
            raise ValueError(f"base_len {req.base_len} != committed_len {session.cache_len + 1}")
        if not req.tokens:
            raise ValueError("tokens must hold the last committed token")
        self._check_ids(req.tokens)
        k = len(req.tokens) - 1
        if session.params.verification is VerificationRule.REJECTION and len(req.q or ()) != k:
            raise ValueError(f"the rejection rule needs q for each of the {k} drafts")
        return session

    def _accept(self, params, base_len, logits, drafts, q) -> RoundResult:
        # Ids past the tokenizer's (a padded vocabulary) are never emitted: greedy looks only
        # at the others; sampling gives them probability 0 (its draws keep the full width).
        if params.verification is VerificationRule.GREEDY:
            return verify_greedy(logits[:, : self.token_count].argmax(dim=-1).cpu().numpy(), drafts)
        if self.token_count < logits.shape[-1]:
            logits = logits.clone()
            logits[:, self.token_count :] = float("-inf")
        p = logits_to_probs(logits.float().cpu().numpy(), params.sampling)  # [k + 1, V]
        rng = round_rng(params.seed, "verify", base_len)
        # Draws no draft decides share their numbers with the edge's drafting at that position.
        noise = SharedNoise(params.seed, p.shape[-1])
        draw = lambda i, probs: noise.draw(base_len + i, probs)  # noqa: E731
        if params.verification is VerificationRule.REJECTION:
            return verify_rejection(p, drafts, q or [], rng, draw)
        return verify_token_only(p, drafts, rng, draw)

    def _timed_pass(self, rows: int) -> float:
        scratch = -1  # never a Triton correlation id (those are unsigned)
        slot = self.forward.slots.open(scratch)
        try:
            t0 = time.perf_counter()
            self.forward([Segment(slot, [0] * rows, want_logits=True)])
            return (time.perf_counter() - t0) * 1e3
        finally:
            self.forward.slots.free(scratch)

    def evict_idle(self, max_idle_s: float) -> list[int]:
        """Ends sessions idle for longer than ``max_idle_s``, or than their lease. A prompt
        still waiting for its rows is work in flight (its Open is not answered), never idle."""
        now = time.monotonic()
        stale = [
            sid
            for sid, s in self.sessions.items()
            if now - s.last_used > (min(max_idle_s, s.lease_s) if s.lease_s else max_idle_s)
            and sid not in self.prefills
        ]
        for sid in stale:
            self.end(sid)
        return stale

    def _get(self, sid: int) -> _Sequence:
        try:
            return self.sessions[sid]
        except KeyError:
            raise SessionNotFound(f"unknown session {sid}") from None

    def _check_ids(self, tokens: Sequence[int]) -> None:
        arr = np.asarray(tokens)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise ValueError(f"token id outside the vocabulary [0, {self.vocab_size})")
