"""A generation's terms and results: what the caller asks for (``GenerationConfig``), and what
it is handed (committed chunks as they arrive, and the generation's statistics).

``GenerationConfig`` lives here, below the client and the mode loops that all read it, so that
none of them imports another to name it (tests/test_imports.py: no import cycle).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from specsplit.edge.drafting import DEFAULT_Q_ENTRIES
from specsplit.edge.retry import DEFAULT_WINDOW_S
from specsplit.shared.acceptance import VerificationRule
from specsplit.shared.sampling import Q_LEVELS, SamplingConfig
from specsplit.shared.session_mode import SessionMode
from specsplit.shared.spec_counts import StepCounts

if TYPE_CHECKING:
    from specsplit.shared.protocol import pb


AUTO = "auto"  # not a session mode but a plan (edge.session_plan): the mode to start, a switch
SESSION_MODES = (AUTO, *(m.value for m in SessionMode if m.drafts))  # GenerationConfig's


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 128
    sampling: SamplingConfig = SamplingConfig()
    # None: a fresh random seed per request, reported in stats.seed (a sampled split request's
    # is the edge's pick, sent in Start: edge.client._own_seed; cloud-only's the server's); give
    # one to reproduce a run.
    seed: int | None = None
    # The largest k. Each round drafts the k in [0, max_draft_tokens] that maximises expected tokens
    # per second (edge/adaptive.py) unless ``adaptive`` is False (then exactly max_draft_tokens).
    max_draft_tokens: int = 8
    adaptive: bool | None = None  # None: adapt, except in a seeded sampled run (reproducible)
    # Draft at most the cloud's per-verdict hint (it shortens blocks when the cloud is
    # compute-bound). False keeps k fixed (adaptive too): seeded sampled runs then repeat exactly
    # whatever the cloud's load and timing (the output's distribution is the target's either way).
    follow_hint: bool = True
    # "lock-step": draft, send, wait for the verdict. "cloud-led": the cloud generates without
    # waiting and verifies whatever drafts arrived in time (docs/design.md#cloud-led): about as fast
    # as cloud-only however long the RTT, not always faster (measured 0.97-1.19x cloud-only at
    # 500-1000 ms: README.md, docs/benchmarks.md). "auto": cloud-led from Start where nothing
    # is measured on the link yet or where the link says so (edge/session_plan.py), else
    # lock-step with adaptive k, switching to cloud-led once its measurements say that is
    # faster (edge/mode_switch.py: a round trip
    # long next to the cloud's step, or a draft that predicts little); lock-step with a fixed k
    # when a run must repeat exactly: follow_hint False, or a seed with temperature > 0 (a
    # cloud-led or adaptive run's blocks depend on timing; greedy output never does).
    session_mode: str = AUTO  # edge.session_plan.SESSION_MODES; SessionPlan reads it
    verification: VerificationRule | None = None  # None: greedy at temperature 0, else rejection
    stop_ids: tuple[int, ...] = ()
    q_entries: int = DEFAULT_Q_ENTRIES
    # The draft samples from q quantised to this many steps and sends one byte per entry
    # (SparseDistribution.counts); 0 samples from and sends float q (4 bytes per entry).
    q_levels: int = Q_LEVELS
    model: str = ""  # target model name; "" = the server's default
    # After UNAVAILABLE, or a busy cloud's RESOURCE_EXHAUSTED that says when to try again,
    # re-open from the committed sequence with backoff for up to this long per outage
    # (edge/retry.py); never once the final verdict came.
    retry_window_s: float = DEFAULT_WINDOW_S
    # While a verdict is in flight, draft the next block for "all accepted, bonus = the draft's
    # guess" (its top token when greedy, its own draw with the shared numbers when sampling,
    # edge.proposer.Proposer.guess_next); used when the verdict matches
    # (docs/design.md#performance). Output is the same either way.
    draft_ahead: bool = True
    # Greedy cloud-led speculations also draft, where the draft is unsure of a token, the
    # continuation after its second choice and send it as a Draft, so that the pass after a
    # correction to that token verifies it instead of nothing (edge/cloud_led.py, branch-ahead).
    # Output is the same either way; never at T > 0. Off by default: at RTT 100 ms it made
    # fewer passes after a correction draftless but no measurable tokens/s, for extra draft
    # steps on the device (docs/design.md#cloud-led).
    branch_ahead: bool = False

    @property
    def reproducible(self) -> bool:
        """A seeded sampled run: its blocks must not depend on timing."""
        return self.seed is not None and not self.sampling.greedy

    @property
    def obeys_hint(self) -> bool:
        """Lock-step blocks shrink to the cloud's hint, unless the run must repeat exactly."""
        return self.follow_hint and not self.reproducible

    @property
    def adapts(self) -> bool:
        adaptive = not self.reproducible if self.adaptive is None else self.adaptive
        return adaptive and self.follow_hint

    @property
    def may_lead(self) -> bool:
        """Lock-step rounds may switch to cloud-led (session mode auto, k adapting: a run that
        must repeat exactly keeps lock-step with a fixed k)."""
        return self.session_mode == AUTO and self.adapts


@dataclass
class GenerationStats:
    route: str  # edge.client.ROUTES: split, cloud-only or edge-only
    new_tokens: int = 0
    rounds: int = 0  # Verdicts
    drafted: int = 0  # draft tokens the target verified (shared.spec_counts), stale ones never
    accepted: int = 0
    target_forward_passes: int = 0
    wall_s: float = 0.0
    ttft_s: float | None = None
    bytes_up: int = 0
    bytes_down: int = 0
    retries: int = 0  # streams re-opened after UNAVAILABLE
    ahead_hits: int = 0  # rounds whose block was drafted while the previous verdict was in flight
    drafts_sent: int = 0  # cloud-led: Drafts sent
    drafts_dropped: int = 0  # cloud-led: Drafts the cloud dropped as stale (never verified)
    lead_round: int = 0  # auto: the lock-step round whose Draft switched to cloud-led (0: none)
    # auto: Start asked for cloud-led (edge.session_plan: the client's link said so, or nothing
    # was measured on it)
    led_at_start: bool = False
    cloud_took_lead: bool = False  # auto: the cloud switched to cloud-led itself (Verdict.led)
    # cloud-led: target passes right after a pass that rejected a draft, and of them those that
    # verified no draft (the edge's drafts after the correction had not reached the cloud) ...
    passes_after_rejection: int = 0
    draftless_after_rejection: int = 0
    # ... and of those, the ones before whose Verdict the edge had sent no Draft after the
    # correction (it had nothing consistent to send); the others had one on its way that the
    # step did not wait for (cloud.gateway.cloud_led: waiting did not pay, or its bound ran out)
    draftless_none_sent: int = 0
    # cloud-led corrections (Verdicts that rejected a draft token), those whose token a branch
    # had been sent for (a Draft holding it at that position after the same prefix, edge.
    # cloud_led branch-ahead) before the Verdict came, the passes right after a correction that
    # verified a branch, and the branch Drafts sent
    corrections: int = 0
    corrections_branched: int = 0
    branch_passes: int = 0
    branches_sent: int = 0
    # cloud-led draft workers stopped because a Verdict rejected the token they continued (their
    # pass cut short where the drafter can: OnnxDrafter.interrupt)
    interrupted: int = 0
    # per session mode the rounds ran in ("lock-step", "cloud-led"): [target passes, tokens
    # committed, ms Verdict to Verdict] (edge.mode_switch.Yield: what each mode yielded)
    mode_passes: dict[str, list[float]] = field(default_factory=dict)
    start_rtt_ms: float | None = None  # Start to Started, minus the server's part of it
    finish: str = ""
    seed: int | None = None  # the seed in force (the server's pick when none was given)
    draft_ms: list[float] = field(default_factory=list)  # per round, drafting on the edge
    round_ms: list[float] = field(default_factory=list)  # per round, send -> verdict
    verify_ms: list[float] = field(default_factory=list)  # per round, target forward (server)
    server_ms: list[float] = field(default_factory=list)  # per round, at the gateway
    queue_ms: list[float] = field(default_factory=list)  # per round, Triton overhead
    max_draft_tokens_hint: list[int] = field(
        default_factory=list
    )  # per round, the cloud's largest k wanted
    k_chosen: list[int] = field(default_factory=list)  # per round, the adaptive k
    batch_sessions: list[int] = field(default_factory=list)  # per round, sessions in its pass
    batch_rows: list[int] = field(default_factory=list)  # per round, rows of its pass
    token_times_s: list[float] = field(default_factory=list)  # commit time of each token
    # Per draft (a step that verified k > 0 draft tokens; vLLM's vocabulary, as the gateway's
    # metrics count them):
    draft_lens: list[int] = field(default_factory=list)  # k
    accepted_lens: list[int] = field(default_factory=list)  # drafts accepted
    emitted_lens: list[int] = field(default_factory=list)  # tokens committed (accepted + bonus)

    # The writers. Each field has one: the loops and the transport write through these
    # methods (or, for the chunks, ``Generation``; for retries, edge.client), never field by
    # field, so that what a field counts is decided in one place.

    def observe_started(self, rtt_ms: float | None, seed: int) -> None:
        """Started (edge.stream): Start's round trip, the server's part taken out, and the seed
        in force; edge-only, which opens no stream, reports its own seed and no round trip."""
        self.start_rtt_ms, self.seed = rtt_ms, seed

    def observe_finished(
        self, reason: str, target_forward_passes: int = 0, drafts_dropped: int = 0
    ) -> None:
        """The generation's end: Finished's counts (edge.stream), or, where no Finished came
        (edge-only, a goodbye lost after the final Verdict), the finish reason alone."""
        self.target_forward_passes += target_forward_passes
        self.drafts_dropped += drafts_dropped
        self.finish = reason

    def observe_round(
        self, v: pb.Verdict, round_ms: float, draft_ms: float | None = None
    ) -> StepCounts:
        """One Verdict's statistics, as the gateway's metrics count it; returns what it counts
        for (shared.spec_counts: what the target verified, not what was sent). ``draft_ms``:
        the edge's drafting for it, None in a session mode that drafts nothing (cloud-only,
        which keeps fewer timings)."""
        step = self.observe_step(StepCounts.of(v))
        self.round_ms.append(round_ms)
        self.verify_ms.append(v.timings.verify_ms)
        if draft_ms is not None:
            self.draft_ms.append(draft_ms)
            self.server_ms.append(v.timings.server_ms)
            self.queue_ms.append(v.timings.queue_ms)
        self.batch_sessions.append(v.timings.batch_sessions)
        self.batch_rows.append(v.timings.batch_rows)
        return step

    def observe_pass(self, mode: str, tokens: int, ms: float) -> None:
        """One Verdict of session mode ``mode`` (edge.mode_switch.LOCK_STEP or CLOUD_LED) into
        ``mode_passes``: ``tokens`` committed, ``ms`` since the Verdict before."""
        counts = self.mode_passes.setdefault(mode, [0, 0, 0.0])
        counts[0] += 1
        counts[1] += tokens
        counts[2] += ms

    def observe_hint(self, hint: int) -> None:
        """A Verdict's max_draft_tokens_hint that the rounds followed."""
        self.max_draft_tokens_hint.append(hint)

    def observe_lockstep_round(self, k: int | None, ahead_hit: bool) -> None:
        """A lock-step round's own figures: ``k`` its adaptive draft length (None: k fixed),
        ``ahead_hit`` whether its block was drafted while the previous verdict was in flight."""
        if k is not None:
            self.k_chosen.append(k)
        self.ahead_hits += ahead_hit

    def observe_lead(self, round_no: int, by_cloud: bool) -> None:
        """The stream went on cloud-led: from lock-step round ``round_no`` (0: not from a
        lock-step round), ``by_cloud`` when the cloud took the lead itself (Verdict.led)."""
        if round_no:
            self.lead_round = round_no
        self.cloud_took_lead |= by_cloud

    def observe_cloud_led_pass(
        self, step: StepCounts, after_rejection: bool, sent: bool, branch: bool = False
    ) -> None:
        """A cloud-led pass (``step``, its counts), ``after_rejection``: the pass before
        corrected a draft; ``sent``: a Draft after that correction had left the edge before
        this pass's Verdict came; ``branch``: the pass verified a branch Draft."""
        if after_rejection:
            self.passes_after_rejection += 1
            self.draftless_after_rejection += step.drafted == 0
            self.draftless_none_sent += step.drafted == 0 and not sent
            self.branch_passes += branch

    def observe_correction(self, branched: bool) -> None:
        """A cloud-led Verdict that corrected a draft token; ``branched``: a branch holding the
        correction there had left the edge before the Verdict came."""
        self.corrections += 1
        self.corrections_branched += branched

    def observe_interrupt(self) -> None:
        self.interrupted += 1

    def observe_drafts_sent(self, n: int, branches: int = 0) -> None:
        """Cloud-led rounds' Drafts that reached the stream, ``branches`` of them branches."""
        self.drafts_sent += n
        self.branches_sent += branches

    def observe_step(self, step: StepCounts) -> StepCounts:
        """Counts one target step, in any session mode, as the gateway's metrics count it."""
        self.rounds += 1
        self.drafted += step.drafted
        self.accepted += step.accepted
        if step.is_draft:  # steps that verified nothing are not drafts
            self.draft_lens.append(step.drafted)
            self.accepted_lens.append(step.accepted)
            self.emitted_lens.append(step.emitted)
        return step

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.new_tokens / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per draft (vLLM's 1 + accepted / drafts when every draft has a bonus)."""
        return sum(self.emitted_lens) / len(self.emitted_lens) if self.emitted_lens else 0.0

    @property
    def accepted_per_position(self) -> list[int]:
        """[i]: drafts whose token at position i was accepted."""
        longest = max(self.draft_lens, default=0)
        return [sum(a > i for a in self.accepted_lens) for i in range(longest)]

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        """[i]: of the drafts with a token at position i, the share whose token there was kept."""
        reached = [
            sum(k > i for k in self.draft_lens) for i in range(max(self.draft_lens, default=0))
        ]
        return [a / n for a, n in zip(self.accepted_per_position, reached, strict=True)]

    @property
    def acceptance_histogram(self) -> list[int]:
        """[a]: drafts with exactly a tokens accepted."""
        hist = [0] * (max(self.draft_lens, default=0) + 1)
        for a in self.accepted_lens:
            hist[a] += 1
        return hist

    def summary(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if not isinstance(v, list)}
        d.update(
            acceptance_rate=self.acceptance_rate,
            tokens_per_round=self.tokens_per_round,
            tokens_per_s=self.tokens_per_s,
            # vLLM's per-request spec-decode figures
            num_drafts=len(self.draft_lens),
            num_emitted_tokens=sum(self.emitted_lens),
            draft_acceptance_rate=self.acceptance_rate,
            mean_acceptance_length=self.mean_acceptance_length,
            accepted_per_position=self.accepted_per_position,
            acceptance_rate_per_position=self.acceptance_rate_per_position,
            acceptance_histogram=self.acceptance_histogram,
        )
        return d


class Generation:
    """Async iterable of committed token chunks; ``stats`` and ``token_ids`` fill in as it runs."""

    def __init__(self, chunks: AsyncIterator[list[int]], stats: GenerationStats):
        self._chunks = chunks
        self.stats = stats
        self.token_ids: list[int] = []

    async def __aiter__(self):
        t0 = time.perf_counter()
        try:
            async for chunk in self._chunks:
                now = time.perf_counter() - t0
                if chunk and self.stats.ttft_s is None:
                    self.stats.ttft_s = now
                self.stats.token_times_s += [now] * len(chunk)
                self.token_ids += chunk
                self.stats.new_tokens = len(self.token_ids)
                yield chunk
        finally:
            self.stats.wall_s = time.perf_counter() - t0

    async def collect(self) -> list[int]:
        async for _ in self:
            pass
        return self.token_ids
