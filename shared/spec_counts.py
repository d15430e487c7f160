"""What one Verdict counts for in the spec-decode figures, written once for both sides: the
gateway's Prometheus counters (cloud.gateway.metrics) and the edge's ``GenerationStats``
(edge.generation) read every Verdict through ``StepCounts.of``, in every session mode, so the
two agree exactly.

vLLM's vocabulary. A step's *drafted* tokens are the draft tokens the target verified in it,
``Verdict.drafts_verified``: a lock-step Draft's k; in a cloud-led step, the part of the freshest
consistent Draft beyond committed_len that the step verified. Drafts the cloud dropped as stale
were never verified and are drafted on neither side (``Finished.drafts_dropped`` counts them).
A step with drafted > 0 is a *draft*; its *accepted* tokens are the leading drafts the target
kept; *emitted* = accepted + the correction or bonus token (absent when a stop came first).
Steps that verify nothing (cloud-only, a cloud-led step no Draft fitted, a k = 0 round) commit
tokens but are not drafts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specsplit.shared.protocol import pb


@dataclass(frozen=True)
class StepCounts:
    drafted: int  # draft tokens the target verified in this step
    accepted: int  # of them, the leading ones it kept
    emitted: int  # tokens the step committed: accepted + the correction or bonus

    @classmethod
    def of(cls, v: pb.Verdict) -> StepCounts:
        return cls(v.drafts_verified, v.accepted, v.accepted + int(v.has_token))

    @property
    def is_draft(self) -> bool:
        return self.drafted > 0
