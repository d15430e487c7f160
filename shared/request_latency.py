"""The request-latency histograms both servers export, named and bucketed as vLLM's, so that
dashboards and alerts written for vLLM read ours with the prefix swapped
(``vllm:time_to_first_token_seconds`` -> ``<prefix>_time_to_first_token_seconds``).

The gateway (``cloud.gateway.metrics``) measures per stream from a Start's arrival; the edge's
OpenAI endpoint (``edge.openai.metrics``) per request from the moment it took it. Each passes its
own help text, since what "first token" means differs by where it is measured; the names and the
buckets are the same. ``prometheus_client`` is imported only when histograms are built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Seconds, from a loopback round to a slow link's long generation (vLLM's buckets).
TTFT_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
          7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
         10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
         120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


@dataclass(frozen=True)
class LatencyHistograms:
    ttft: Any  # prometheus_client.Histogram: time to first token
    itl: Any  # inter-token latency: one interval per commit (a round commits several tokens)
    e2e: Any  # end-to-end request latency


def latency_histograms(
    prefix: str, registry, *, ttft_doc: str, itl_doc: str, e2e_doc: str
) -> LatencyHistograms:
    """The three histograms, registered in ``registry`` under ``prefix``."""
    from prometheus_client import Histogram

    def histogram(name: str, doc: str, buckets: tuple[float, ...]):
        return Histogram(f"{prefix}_{name}", doc, buckets=buckets, registry=registry)

    return LatencyHistograms(
        ttft=histogram("time_to_first_token_seconds", ttft_doc, TTFT_S),
        itl=histogram("inter_token_latency_seconds", itl_doc, ITL_S),
        e2e=histogram("e2e_request_latency_seconds", e2e_doc, E2E_S),
    )
