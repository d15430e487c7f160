"""Sampling transforms: logits -> the distribution a request samples from.

Both sides use these: the cloud to build the target distribution p, the edge to build the draft
distribution q. numpy only (the edge has no torch). The order is fixed and documented in the
protocol: temperature, then top-k, then top-p.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling parameters of one request. temperature == 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # 1 disables

    def __post_init__(self) -> None:
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def softmax(logits: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, in float64 for stable ratios p/q."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    np.exp(x, out=x)
    x /= x.sum(axis=-1, keepdims=True)
    return x


def _top_k_mask(logits: np.ndarray, top_k: int) -> np.ndarray:
    # logits: [rows, V]; keeps ties with the k-th value, like torch's topk-threshold idiom.
    kth = np.partition(logits, -top_k, axis=-1)[:, -top_k][:, None]
    return logits >= kth


def _top_p_mask(probs: np.ndarray, top_p: float) -> np.ndarray:
    # probs: [rows, V]. Keep the smallest prefix of the descending order whose mass reaches top_p;
    # a token is kept when the mass strictly before it is < top_p (so the top token always is).
    order = np.argsort(-probs, axis=-1, kind="stable")
    sorted_p = np.take_along_axis(probs, order, axis=-1)
    mass_before = np.cumsum(sorted_p, axis=-1) - sorted_p
    keep_sorted = mass_before < top_p
    keep = np.empty_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, axis=-1)
    return keep


def logits_to_probs(logits: np.ndarray, cfg: SamplingConfig) -> np.ndarray:
    """Distribution after temperature, top-k, top-p. logits: [..., V] -> probs [..., V] float64.

    Greedy (temperature 0) returns the one-hot argmax distribution, so every rule below also holds
    for greedy decoding.
    """
    x = np.asarray(logits, dtype=np.float64)
    shape = x.shape
    x = x.reshape(-1, shape[-1])  # [rows, V]
    if cfg.greedy:
        out = np.zeros_like(x)
        out[np.arange(x.shape[0]), x.argmax(axis=-1)] = 1.0
        return out.reshape(shape)
    x = x / cfg.temperature
    if 0 < cfg.top_k < x.shape[-1]:
        x = np.where(_top_k_mask(x, cfg.top_k), x, -np.inf)
    probs = softmax(x)
    if cfg.top_p < 1.0:
        probs = np.where(_top_p_mask(probs, cfg.top_p), probs, 0.0)
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs.reshape(shape)


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from probs [V] by inverse CDF. Tokens with probability 0 are never drawn."""
    cdf = np.cumsum(probs)
    # side="right": index i satisfies cdf[i-1] <= u < cdf[i], so p[i] > 0.
    i = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return min(i, len(probs) - 1)


@dataclass(frozen=True)
class SparseDist:
    """A distribution over a truncated support: ids [m] int64, probs [m] float64, summing to 1.

    Ids outside the support have probability exactly 0. This is how q travels on the wire.
    """

    ids: np.ndarray  # [m] int64
    probs: np.ndarray  # [m] float64
    # [m] uint8 when quantised: probs == counts / counts.sum() exactly (see ``quantise``)
    counts: np.ndarray | None = None

    def prob_of(self, token: int) -> float:
        hit = np.flatnonzero(self.ids == token)
        return float(self.probs[hit[0]]) if hit.size else 0.0

    def dense(self, vocab_size: int) -> np.ndarray:
        out = np.zeros(vocab_size, dtype=np.float64)
        out[self.ids] = self.probs
        return out


def truncate(probs: np.ndarray, max_entries: int) -> SparseDist:
    """Keep the max_entries most likely tokens of probs [V] and renormalise.

    The truncated distribution is the draft's q: the draft samples from it, so sending its support
    is exact, not an approximation.
    """
    nz = np.flatnonzero(probs > 0)
    if nz.size > max_entries:
        top = np.argpartition(probs[nz], -max_entries)[-max_entries:]
        nz = nz[top]
    p = probs[nz]
    return SparseDist(ids=nz.astype(np.int64), probs=p / p.sum())


Q_LEVELS = 127  # quantised q: steps of about 1/127, one byte per entry (bench/qbytes.py)


def quantise(q: SparseDist, levels: int = Q_LEVELS) -> SparseDist:
    """q rounded to integer counts c_j <= levels, entries rounded to 0 dropped, and
    probs = c / sum(c) in float64.

    The edge SAMPLES from this quantised q and sends the counts (one byte each): the cloud
    rebuilds probs with the same float64 division, so the q it verifies against is bit for bit
    the q the draft token came from, and speculative sampling stays exact. Dropping entries below
    half a step costs acceptance at most their mass (≤ m / (2 * levels)).
    """
    assert 1 <= levels <= 255, levels
    counts = np.floor(q.probs * levels + 0.5)
    counts[np.argmax(q.probs)] = max(1.0, counts[np.argmax(q.probs)])  # never an empty support
    keep = counts > 0
    return from_counts(q.ids[keep], counts[keep].astype(np.uint8))


def from_counts(ids: np.ndarray, counts: np.ndarray) -> SparseDist:
    """The distribution counts / sum(counts) over ``ids`` (both sides compute it the same way)."""
    c = np.asarray(counts, dtype=np.uint8)
    probs = c.astype(np.float64) / float(c.sum(dtype=np.int64))
    return SparseDist(ids=np.asarray(ids, dtype=np.int64), probs=probs, counts=c)
