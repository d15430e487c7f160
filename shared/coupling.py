"""Shared random numbers for the draws edge and cloud make at the same position.

When the cloud draws a token from p with no draft deciding it (a cloud-led step that found no
fitting Draft, the bonus after an accepted block, all tokens of token-only) and the edge drew
its speculation for that position from q, the two agree only by chance. With independent numbers
that chance is sum_x p(x) q(x): on flat distributions (prose at T=0.7) it is often below one half,
so the edge's speculation past such a position is mostly wasted. Drawing both with the same
numbers couples them (the Gumbel-max / exponential-race coupling, Daliri, Musco and Suresh 2024,
"Coupling without communication and drafter-invariant speculative decoding"): each side takes
argmax_x w(x) / E_x over its own weights w with one shared vector E of Exp(1) variables per
position, so they agree with probability at least (1 - TV) / (1 + TV), and always when p == q.

Each draw is still an exact sample of its own distribution (an exponential race), so nothing
about losslessness changes as long as the shared numbers never feed an accept test: those, and
the corrections drawn from the residual, keep the verifier's own stream (shared/seeding.py). The
numbers are a function of (seed, position) only, so a re-opened session draws the same ones. If
the two sides ever computed different numbers (another numpy), output would stay exact; only the
coupling, and with it the acceptance, would be lost.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict

import numpy as np

from specsplit.shared.sampling import SparseDist

_SIDE = zlib.crc32(b"coupled")
_CACHED = 4  # the edge redraws a position after each fork of its speculation


def exponentials(seed: int, pos: int, n: int) -> np.ndarray:
    """E_0..E_{n-1} ~ Exp(1) for the token at sequence index ``pos``. A shorter n gives a prefix
    of a longer one (numpy fills in order), so draft and target vocabularies of different sizes
    still share numbers for every id they both have."""
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(_SIDE, pos)))
    # Exp(1) is 0 with probability 0, but a 0 would turn 0 / 0 into nan in the race below.
    return np.maximum(rng.standard_exponential(n), np.finfo(np.float64).tiny)


def race(weights: np.ndarray, e: np.ndarray) -> int:
    """argmax_x weights[x] / e[x]: a sample of weights / sum(weights) (x with weight 0 never
    wins while some weight is positive)."""
    return int(np.argmax(weights / e[: weights.shape[-1]]))


class SharedNoise:
    """The shared numbers of one session (its seed), drawn per position."""

    def __init__(self, seed: int, vocab_size: int):
        self.seed, self.vocab_size = int(seed), int(vocab_size)
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()

    def at(self, pos: int) -> np.ndarray:
        e = self._cache.pop(pos, None)
        if e is None:
            e = exponentials(self.seed, pos, self.vocab_size)
        self._cache[pos] = e
        while len(self._cache) > _CACHED:
            self._cache.popitem(last=False)
        return e

    def draw(self, pos: int, probs: np.ndarray) -> int:
        """A token from the dense distribution ``probs`` [V] at sequence index ``pos``."""
        return race(probs, self.at(pos))

    def draw_sparse(self, pos: int, q: SparseDist) -> int:
        """A token from the sparse ``q`` at sequence index ``pos`` (its ids must be < V)."""
        return int(q.ids[np.argmax(q.probs / self.at(pos)[q.ids])])
