"""Prometheus metrics of ``specsplit-edge serve`` (``/metrics``), named after vLLM's, so that
dashboards and benchmarking tools built for vLLM read them with the prefix swapped
(``vllm:time_to_first_token_seconds`` -> ``specsplit_edge_time_to_first_token_seconds``):

- latency histograms per request: time to first token and end-to-end latency from the moment
  the endpoint took the request (tokenised; waiting for a slot counts), and the inter-token
  latency between successive commits (a round commits several tokens at once: one interval per
  round, as vLLM observes one per engine step);
- counters: prompt and generation tokens, requests by finish reason, and the spec-decode
  counters in vLLM's vocabulary (shared.spec_counts: drafts, draft tokens, accepted tokens,
  accepted tokens per position), summed over the requests' ``GenerationStats``.

``speculative_decoding`` gives one request's figures in vLLM's ``SpecDecodingStats`` shape; the
endpoint answers them as ``metrics.speculative_decoding`` in each completion.

Each endpoint owns a private ``CollectorRegistry`` (several apps in one process never collide).
"""

from __future__ import annotations

from specsplit.edge.generation import GenerationStats
from specsplit.shared.request_latency import latency_histograms

PREFIX = "specsplit_edge"


def speculative_decoding(stats: GenerationStats) -> dict:
    """One request's spec-decode figures, as vLLM's ``SpecDecodingStats`` names them."""
    return {
        "num_drafts": len(stats.draft_lens),
        "num_draft_tokens": sum(stats.draft_lens),
        "num_accepted_tokens": sum(stats.accepted_lens),
        "num_accepted_tokens_per_pos": stats.accepted_per_position,
    }


def commit_intervals(token_times_s: list[float]) -> list[float]:
    """Seconds between successive commits (tokens of one round share their commit time)."""
    commits = [t for i, t in enumerate(token_times_s) if i == 0 or t != token_times_s[i - 1]]
    return [b - a for a, b in zip(commits, commits[1:], strict=False)]


class EdgeMetrics:
    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = reg = CollectorRegistry()
        p = PREFIX
        self.running = Gauge(f"{p}_num_requests_running", "requests generating", registry=reg)
        latency = latency_histograms(
            p,
            reg,
            ttft_doc="request taken to its first token committed",
            itl_doc="between successive commits of a request's tokens",
            e2e_doc="request taken to its last token",
        )
        self.ttft, self.itl, self.e2e = latency.ttft, latency.itl, latency.e2e
        self.prompt_tokens = Counter(f"{p}_prompt_tokens", "prompt tokens", registry=reg)
        self.generation_tokens = Counter(f"{p}_generation_tokens", "tokens generated", registry=reg)
        self.success = Counter(
            f"{p}_request_success", "requests answered", ["finished_reason"], registry=reg
        )
        spec = f"{p}_spec_decode"
        self.drafts = Counter(f"{spec}_num_drafts", "drafts verified (k > 0)", registry=reg)
        self.drafted = Counter(f"{spec}_num_draft_tokens", "tokens drafted", registry=reg)
        self.accepted = Counter(f"{spec}_num_accepted_tokens", "drafts accepted", registry=reg)
        self.accepted_per_pos = Counter(
            f"{spec}_num_accepted_tokens_per_pos",
            "drafts whose token at this position was accepted",
            ["position"],
            registry=reg,
        )

    def observe(
        self,
        stats: GenerationStats,
        prompt_tokens: int,
        generated: int,
        finish: str,
        started_s: float,
        e2e_s: float,
    ) -> None:
        """One answered request: ``started_s``, when its generation began after the request was
        taken (the slot's wait); ``e2e_s``, taken to answered."""
        if stats.ttft_s is not None:
            self.ttft.observe(started_s + stats.ttft_s)
        for gap in commit_intervals(stats.token_times_s):
            self.itl.observe(gap)
        self.e2e.observe(e2e_s)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated)
        self.success.labels(finish).inc()
        spec = speculative_decoding(stats)
        self.drafts.inc(spec["num_drafts"])
        self.drafted.inc(spec["num_draft_tokens"])
        self.accepted.inc(spec["num_accepted_tokens"])
        for pos, n in enumerate(spec["num_accepted_tokens_per_pos"]):
            self.accepted_per_pos.labels(str(pos)).inc(n)

    def exposition(self) -> tuple[bytes, str]:
        """The text ``/metrics`` answers, and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
