"""Recorded draft blocks, replayed: many edge sessions from one core without drafting live.

The load benchmark measures the cloud. On this 2-core machine 32 live ONNX drafters would make
the edge core the bottleneck, so the benchmark records the exact blocks the real draft model
produces for each prefix, then replays them: the client sends the same Draft messages (tokens
and q) it would send drafting live, and the cloud cannot tell the difference.

``ReplayDrafter`` is an ``edge.proposer.Proposer``: the client's loops draft through it exactly
as through the live draft model, lock-step and cloud-led alike, under the stream's ``DraftRule``.

A block depends only on (seed, prefix): the drafter is deterministic and its sampler is keyed by
(seed, prefix length), and the first k of a block of k_max drafts equal a block of k drafts.
So one recording of ``K_MAX + 1`` drafts per prefix serves every k the cloud's hint picks, and
the draft after each of its prefixes (a draft-ahead's guess, a cloud-led speculation's token).

- Greedy: every prefix a session can reach is a prefix of the target's greedy output, so
  priming (``bench.load.prime``) drafts after each of them and replay never misses. A block
  drafted ahead for a guessed prefix off that path is never used (the guess was wrong), and
  replays empty.
- Sampled: the committed sequence depends on the block sizes, so a replay can reach prefixes
  the recording did not; those are drafted live on the spot and counted (``misses``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from specsplit.edge.drafting import Block, DraftRule
from specsplit.edge.proposer import DraftModelProposer, Proposer
from specsplit.shared.sampling import Q_LEVELS, SamplingConfig, SparseDist

K_MAX = 8  # the largest block replayed; the edge's own k is at most this


class ReplayDrafter(Proposer):
    """A Proposer for ``SplitClient`` that serves recorded blocks (see the module docstring)."""

    def __init__(self, live, greedy: bool):
        self.live, self.greedy = live, greedy
        self.vocab_size, self.eos_token_ids = live.vocab_size, live.eos_token_ids
        self.tokenizer_fingerprint = getattr(live, "tokenizer_fingerprint", None)
        self.token_count = getattr(live, "token_count", None)
        self.blocks: dict[tuple[int, ...], Block] = {}
        # prefix -> the draft after it and its q: what a draft-ahead guesses after
        # committed + d_1..d_j is d_(j+1), drawn as d_(j+1) itself was (edge.proposer)
        self.nexts: dict[tuple[int, ...], tuple[int, SparseDist | None]] = {}
        self.hits = self.misses = self.off_path = 0
        self.log: list | None = None  # fingerprints of proposed blocks, when set to a list
        self._live = DraftModelProposer(live)
        self._lock = threading.Lock()  # the live drafter has one KV cache

    # the Proposer -----------------------------------------------------------------------------

    def propose(self, committed, k, rule: DraftRule, stop=None) -> Block:
        block = self._propose(committed, k, rule, stop)
        if self.log is not None:
            self.log.append(fingerprint(committed, block))
        return block

    def _propose(self, committed, k, rule: DraftRule, stop) -> Block:
        key = tuple(committed)
        block = self.blocks.get(key)
        if block is not None and len(block.tokens) >= k:
            self.hits += 1
            return block.head(k)
        if self.greedy:
            self.off_path += 1  # only a wrong guess of a draft-ahead leads here: never used
            return Block([], None)
        self.misses += 1
        return self._record(committed, rule, stop).head(k)

    def guess_next(self, committed, rule: DraftRule, stop=None) -> int:
        recorded = self.nexts.get(tuple(committed))
        if recorded is not None:
            self.hits += 1
            return recorded[0]
        if self.greedy:
            return -1  # off the greedy path: no verdict will ever match this guess
        self.misses += 1
        with self._lock:
            return self._live.guess_next(committed, rule, stop)

    def next_token(self, committed, rule: DraftRule, stop=None) -> tuple[int, SparseDist | None]:
        recorded = self.nexts.get(tuple(committed))
        if recorded is not None:
            self.hits += 1
            return recorded
        self.misses += 1  # a speculation needs a real token, off the greedy path too
        with self._lock:
            return self._live.next_token(committed, rule, stop)

    # recording ---------------------------------------------------------------------------------

    def record(
        self,
        committed: Sequence[int],
        cfg: SamplingConfig,
        noise,
        q_entries: int,
        q_levels: int = Q_LEVELS,
    ) -> Block:
        """Drafts K_MAX + 1 tokens live after ``committed`` and keeps them."""
        return self._record(committed, DraftRule(cfg, noise, q_entries, q_levels), None)

    def _record(self, committed: Sequence[int], rule: DraftRule, stop) -> Block:
        with self._lock:
            block = self._live.propose(committed, K_MAX + 1, rule, stop)
        key = tuple(committed)
        self.blocks[key] = block
        for j, token in enumerate(block.tokens):
            q = None if block.q is None else block.q[j]
            self.nexts.setdefault(key + tuple(block.tokens[:j]), (token, q))
        return block

    # the Drafter protocol, for anything that asks the drafter directly (edge-only) -------------

    @property
    def cached(self) -> list[int]:
        return self.live.cached

    def forward(self, tokens):
        with self._lock:
            return self.live.forward(tokens)

    def truncate(self, n: int) -> None:
        with self._lock:
            self.live.truncate(n)


class LoggingDrafter(DraftModelProposer):
    """Drafts live and logs every block it proposes: (prefix length, tokens, q ids). Used once
    per benchmark run to show a replayed session sends what a live one sends."""

    def __init__(self, live):
        super().__init__(live)
        self.log: list[tuple] = []

    def propose(self, committed, k, rule: DraftRule, stop=None) -> Block:
        block = super().propose(committed, k, rule, stop)
        self.log.append(fingerprint(committed, block))
        return block


def fingerprint(committed: Sequence[int], block: Block) -> tuple:
    q = () if block.q is None else tuple(tuple(d.ids.tolist()) for d in block.q)
    return (len(committed), tuple(block.tokens), q)
