"""Protocol helpers: the generated stubs, and conversions between proto messages and our types.

Proto types stay at the boundary; inside Python we use the frozen dataclasses of ``shared``.
The stubs ``specsplit.v1`` are generated at build time by the hook in ``setup.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

try:
    from specsplit.v1 import speculative_pb2 as pb
    from specsplit.v1 import speculative_pb2_grpc as pb_grpc  # noqa: F401 (re-export)
except ImportError as e:  # pragma: no cover - only without a build
    raise ImportError(
        "gRPC stubs not generated: install the package (pip install .), or run `make proto`"
    ) from e

from specsplit.shared.acceptance import VerificationRule
from specsplit.shared.sampling import SamplingConfig, SparseDist, from_counts
from specsplit.shared.session_mode import SessionMode

PROTOCOL_VERSION = pb.PROTOCOL_VERSION_1
SERVICE_NAME = "specsplit.v1.SpeculativeDecoding"
# A RESOURCE_EXHAUSTED refusal's trailing metadata: when to try again, in ms (absent: not soon)
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"  # gRPC's own retry policy honours it (gRFC A6)
RETRY_AFTER_KEY = "retry-after-ms"  # the same hint for clients that retry by hand (the edge)

VERIFICATION_TO_PB = {
    VerificationRule.GREEDY: pb.VERIFICATION_RULE_GREEDY,
    VerificationRule.REJECTION: pb.VERIFICATION_RULE_REJECTION,
    VerificationRule.TOKEN_ONLY: pb.VERIFICATION_RULE_TOKEN_ONLY,
}
PB_TO_VERIFICATION = {v: k for k, v in VERIFICATION_TO_PB.items()}
SESSION_MODE_TO_PB = {
    SessionMode.LOCK_STEP: pb.SESSION_MODE_LOCK_STEP,
    SessionMode.CLOUD_LED: pb.SESSION_MODE_CLOUD_LED,
    SessionMode.CLOUD_ONLY: pb.SESSION_MODE_CLOUD_ONLY,
}
PB_TO_SESSION_MODE = {v: k for k, v in SESSION_MODE_TO_PB.items()}


def session_mode_of(start: pb.Start) -> SessionMode:
    """The mode a Start asks for (UNSPECIFIED: lock-step). Raises ValueError on an unknown one."""
    if start.session_mode == pb.SESSION_MODE_UNSPECIFIED:
        return SessionMode.LOCK_STEP
    mode = PB_TO_SESSION_MODE.get(start.session_mode)
    if mode is None:
        raise ValueError(f"unknown session_mode {start.session_mode}")
    return mode


def sampling_params(
    cfg: SamplingConfig, seed: int | None, max_new_tokens: int, stop_ids: Sequence[int] = ()
) -> pb.SamplingParams:
    """seed None leaves the field absent: the server picks one and returns it in Started."""
    return pb.SamplingParams(
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
        seed=seed,
        max_new_tokens=max_new_tokens,
        stop_token_ids=list(stop_ids),
    )


def sparse_to_pb(q: SparseDist, counts_ok: bool = True) -> pb.SparseDistribution:
    """Counts (one byte per entry) when q is quantised and the server takes them, else floats."""
    if q.counts is not None and counts_ok:
        return pb.SparseDistribution(token_ids=q.ids.tolist(), counts=q.counts.tobytes())
    return pb.SparseDistribution(token_ids=q.ids.tolist(), probs=q.probs.tolist())


def sparse_from_pb(msg: pb.SparseDistribution, vocab_size: int) -> SparseDist:
    """Validates and renormalises one position's q. Raises ValueError with the reason."""
    ids = np.asarray(msg.token_ids, dtype=np.int64)
    if msg.counts and len(msg.probs):
        raise ValueError("q sets both probs and counts (exactly one is allowed)")
    n = len(msg.counts) if msg.counts else len(msg.probs)
    if ids.size == 0 or ids.size != n:
        raise ValueError(f"q needs as many probs or counts as token_ids (got {ids.size} and {n})")
    if ids.max() >= vocab_size:
        raise ValueError(f"q token id {int(ids.max())} outside the vocabulary [0, {vocab_size})")
    if np.unique(ids).size != ids.size:
        raise ValueError("q token_ids must be distinct")
    if msg.counts:
        counts = np.frombuffer(msg.counts, dtype=np.uint8)
        if not counts.any():
            raise ValueError("q counts must not all be 0")
        return from_counts(ids, counts)
    probs = np.asarray(msg.probs, dtype=np.float64)
    if not np.all(np.isfinite(probs)) or probs.min() < 0:
        raise ValueError("q probabilities must be finite and >= 0")
    total = probs.sum()
    if abs(total - 1.0) > 1e-3:
        raise ValueError(f"q probabilities must sum to 1 (got {total:.6f})")
    return SparseDist(ids=ids, probs=probs / total)
