"""The draft model's math: a block of draft tokens from a ``Drafter``, the q each was drawn from,
the rule they follow, and edge-only generation. numpy only (no torch on the edge).

A ``Drafter`` owns a KV cache of the tokens in ``cached``; drafting first rolls it back to the
longest prefix it shares with the committed sequence (the cloud may have rejected the tail), then
feeds what is missing and proposes k tokens one at a time. Who asks for drafts, and when, is
``edge.proposer``'s business.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from specsplit.shared.coupling import SharedNoise
from specsplit.shared.sampling import (
    Q_LEVELS,
    SamplingConfig,
    SparseDist,
    logits_to_probs,
    quantise,
    sample,
    softmax,
)

DEFAULT_Q_ENTRIES = 32


class Interrupted(Exception):
    """A forward pass stopped part way by the drafter's ``interrupt()`` (edge.onnx_drafter): the
    cache holds what it held before, plus any whole chunks of a long prompt already run."""


class Drafter(Protocol):
    vocab_size: int
    eos_token_ids: tuple[int, ...]

    @property
    def cached(self) -> list[int]: ...

    # Logits whose last row [-1] follows the last of ``tokens``: [1, V] or [len(tokens), V]
    # (edge.onnx_drafter computes the last row only, unless asked for all).
    def forward(self, tokens: Sequence[int]) -> np.ndarray: ...

    def truncate(self, n: int) -> None: ...


@dataclass(frozen=True)
class DraftRule:
    """How every draft of one stream is drawn: built once per stream, once its seed is known."""

    sampling: SamplingConfig
    noise: SharedNoise | None  # the session's shared numbers (shared/coupling.py); None: greedy
    q_entries: int = DEFAULT_Q_ENTRIES  # q keeps the draft's most likely tokens, this many
    q_levels: int = Q_LEVELS  # q quantised to this many steps (0: float q)

    @classmethod
    def for_seed(
        cls,
        sampling: SamplingConfig,
        seed: int | None,
        vocab_size: int,
        q_entries: int = DEFAULT_Q_ENTRIES,
        q_levels: int = Q_LEVELS,
    ) -> DraftRule:
        """The rule of a session with ``seed``; a sampled draft needs it (Started brings it when
        the request sent none), a greedy one does not."""
        if sampling.greedy:
            return cls(sampling, None, q_entries, q_levels)
        assert seed is not None, "a sampled draft needs the session's seed"
        return cls(sampling, SharedNoise(seed, vocab_size), q_entries, q_levels)


@dataclass(frozen=True)
class Block:
    tokens: list[int]  # d_1..d_k
    q: list[SparseDist] | None  # q_1..q_k when sampling, None when greedy

    def head(self, k: int) -> Block:
        """The first k drafts (each d_i and q_i depend only on what precedes them)."""
        return Block(self.tokens[:k], None if self.q is None else self.q[:k])


def draft_distribution(
    logits: np.ndarray, cfg: SamplingConfig, max_entries: int, q_levels: int = Q_LEVELS
) -> SparseDist:
    """The draft's q from logits [V]: the max_entries most likely tokens, then temperature,
    top-k and top-p within them, then quantised to ``q_levels`` steps (0: float q).

    Truncating first keeps the edge's cost O(m) instead of sorting the whole vocabulary. Any q is
    lossless (the cloud corrects for it) as long as the draft samples from the very q it sends;
    only acceptance depends on how close q is to p.
    """
    m = min(max_entries, cfg.top_k or max_entries, logits.shape[-1])
    ids = np.argpartition(logits, -m)[-m:]
    ids = ids[np.argsort(-logits[ids], kind="stable")]  # descending
    probs = softmax(logits[ids] / cfg.temperature)
    if cfg.top_p < 1.0:
        keep = (np.cumsum(probs) - probs) < cfg.top_p
        ids, probs = ids[keep], probs[keep] / probs[keep].sum()
    q = SparseDist(ids=ids.astype(np.int64), probs=probs)
    return quantise(q, q_levels) if q_levels else q


def draw_next(
    logits: np.ndarray,
    pos: int,
    cfg: SamplingConfig,
    noise: SharedNoise | None,
    q_entries: int = DEFAULT_Q_ENTRIES,
    q_levels: int = Q_LEVELS,
) -> tuple[int, SparseDist | None]:
    """The draft's token at sequence index ``pos`` from its logits [V], and the q it was drawn
    from: the top token when greedy (q None), else a draw from q with the session's shared
    numbers at ``pos``, which couples it with the cloud's own draw there (shared/coupling.py)."""
    if cfg.greedy:
        return int(np.argmax(logits)), None
    assert noise is not None, "sampling needs the session's shared noise"
    q = draft_distribution(logits, cfg, q_entries, q_levels)
    return noise.draw_sparse(pos, q), q


@dataclass(frozen=True)
class Alternative:
    """The draft's second choice at a position, and how sure it was of its first there: its
    probabilities (softmax of its logits at temperature 1) of its top token and of ``token``.
    A greedy cloud-led speculation branches at positions where ``p_top`` is low
    (edge.cloud_led, docs/design.md#cloud-led)."""

    token: int
    p_top: float
    p_alt: float


def alternative(logits: np.ndarray) -> Alternative:
    """The second most likely token after the top one (np.argmax's, ties to the lower id) of
    ``logits`` [V], and the two probabilities."""
    top = int(np.argmax(logits))
    rest = logits.copy()
    rest[top] = -np.inf
    alt = int(np.argmax(rest))
    z = np.exp(logits - logits[top], dtype=np.float64).sum()
    return Alternative(alt, float(1.0 / z), float(np.exp(logits[alt] - logits[top]) / z))


def cached_prefix(drafter: Drafter, committed: Sequence[int]) -> int:
    """How much of ``committed`` a pass after it finds in the drafter's cache: their common
    prefix, short of the last committed token (always fed, for its logits)."""
    cached = drafter.cached
    limit = max(0, min(len(cached), len(committed) - 1))
    if cached[:limit] == list(committed[:limit]):  # the usual case, compared at C speed
        return limit
    n = 0
    while cached[n] == committed[n]:  # a mismatch lies before limit
        n += 1
    return n


def next_logits(drafter: Drafter, committed: Sequence[int]) -> np.ndarray:
    """Rolls the cache back to its common prefix with ``committed``, feeds the rest; returns the
    logits [V] after the last committed token."""
    n = cached_prefix(drafter, committed)
    drafter.truncate(n)
    return drafter.forward(committed[n:])[-1]


def greedy_after(drafter: Drafter, committed: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
    """The draft's top token after ``committed + tokens[:i]`` for i = 0..len(tokens), from one
    pass over what the cache lacks plus ``tokens`` (a drafter whose ``forward`` takes
    ``all_logits``: edge.onnx_drafter). [len(tokens) + 1] token ids."""
    n = cached_prefix(drafter, committed)
    drafter.truncate(n)
    logits = drafter.forward([*committed[n:], *tokens], all_logits=True)  # [fed, V]
    return np.argmax(logits[len(committed) - n - 1 :], axis=-1)


def draft_block(
    drafter: Drafter,
    committed: Sequence[int],
    k: int,
    cfg: SamplingConfig,
    noise: SharedNoise | None,
    q_entries: int = DEFAULT_Q_ENTRIES,
    q_levels: int = Q_LEVELS,
) -> Block:
    """Proposes k tokens after ``committed`` (each by ``draw_next``). d_k is not fed back (the
    verdict decides its fate)."""
    logits = next_logits(drafter, committed)
    tokens: list[int] = []
    qs: list[SparseDist] = []
    for i in range(k):
        token, q = draw_next(logits, len(committed) + i, cfg, noise, q_entries, q_levels)
        tokens.append(token)
        if q is not None:
            qs.append(q)
        if i + 1 < k:
            logits = drafter.forward(tokens[-1:])[-1]
    return Block(tokens=tokens, q=None if cfg.greedy else qs)


def generate_edge_only(
    drafter: Drafter,
    prompt: Sequence[int],
    cfg: SamplingConfig,
    max_new_tokens: int,
    rng: np.random.Generator | None,
    stop_ids: frozenset[int] = frozenset(),
) -> Iterator[int]:
    """The draft model alone (no cloud): yields tokens until EOS, a stop id or the length limit."""
    committed = list(prompt)
    stops = stop_ids | set(drafter.eos_token_ids)
    for _ in range(max_new_tokens):
        logits = next_logits(drafter, committed)
        greedy = cfg.greedy
        token = int(np.argmax(logits)) if greedy else sample(logits_to_probs(logits, cfg), rng)
        committed.append(token)
        yield token
        if token in stops:
            return
