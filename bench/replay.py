"""Recorded draft blocks, replayed: many edge sessions from one core without drafting live.

The load benchmark measures the cloud. On this 2-core machine 32 live ONNX drafters would make
the edge core the bottleneck, so the benchmark records the exact blocks the real draft model
produces for each prefix, then replays them: the client sends the same Draft messages (tokens
and q) it would send drafting live, and the cloud cannot tell the difference.

A block depends only on (seed, prefix): the drafter is deterministic and its sampler is keyed by
(seed, prefix length), and the first k of a block of k_max drafts equal a block of k drafts.
So one recording of ``K_MAX + 1`` drafts per prefix serves every k the cloud's hint picks.

- Greedy: every prefix a session can reach is a prefix of the target's greedy output, so
  ``record_greedy`` drafts after each of them and replay never misses. A block drafted ahead
  for a guessed prefix off that path is never used (the guess was wrong), and replays empty.
- Sampled: the committed sequence depends on the block sizes, so a replay can reach prefixes
  the recording did not; those are drafted live on the spot and counted (``misses``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from specsplit.edge.drafting import Block, draft_block, guess_next
from specsplit.shared.sampling import SamplingConfig

K_MAX = 8  # the largest block replayed; the edge's own k is at most this


class ReplayDrafter:
    """A Drafter for ``SplitClient`` that serves recorded blocks (see the module docstring)."""

    def __init__(self, live, greedy: bool):
        self.live, self.greedy = live, greedy
        self.vocab_size, self.eos_token_ids = live.vocab_size, live.eos_token_ids
        self.blocks: dict[tuple[int, ...], Block] = {}
        self.tops: dict[tuple[int, ...], int] = {}
        self.hits = self.misses = self.off_path = 0
        self.log: list | None = None  # fingerprints of proposed blocks, when set to a list
        self._lock = threading.Lock()  # the live drafter has one KV cache

    # SplitClient's seams (edge.drafting.propose / guess_next) -------------------------------

    def propose(self, committed, k, cfg: SamplingConfig, noise, q_entries) -> Block:
        block = self._propose(committed, k, cfg, noise, q_entries)
        if self.log is not None:
            self.log.append(fingerprint(committed, block))
        return block

    def _propose(self, committed, k, cfg: SamplingConfig, noise, q_entries) -> Block:
        key = tuple(committed)
        block = self.blocks.get(key)
        if block is not None and len(block.tokens) >= k:
            self.hits += 1
            return block.head(k)
        if self.greedy:
            self.off_path += 1  # only a wrong guess of a draft-ahead leads here: never used
            return Block([], None)
        self.misses += 1
        return self.record(committed, cfg, noise, q_entries).head(k)

    def guess_next(self, committed, cfg: SamplingConfig, noise, q_entries) -> int:
        top = self.tops.get(tuple(committed))
        if top is not None:
            self.hits += 1
            return top
        if self.greedy:
            return -1  # off the greedy path: no verdict will ever match this guess
        self.misses += 1
        with self._lock:
            return guess_next(self.live, committed, cfg, noise, q_entries)

    # recording ---------------------------------------------------------------------------------

    def record(self, committed: Sequence[int], cfg: SamplingConfig, noise, q_entries) -> Block:
        """Drafts K_MAX + 1 tokens live after ``committed`` and keeps them."""
        with self._lock:
            block = draft_block(self.live, committed, K_MAX + 1, cfg, noise, q_entries)
        key = tuple(committed)
        self.blocks[key] = block
        # What a draft-ahead guesses after committed + d_1..d_j is d_(j+1): the top token when
        # greedy, and when sampling the draw from q_(j+1) with the shared numbers of its
        # position, which is how d_(j+1) itself was drawn (edge.drafting.guess_next).
        for j in range(len(block.tokens)):
            self.tops.setdefault(key + tuple(block.tokens[:j]), block.tokens[j])
        return block

    # the Drafter protocol, for anything that asks the drafter directly --------------------------

    @property
    def cached(self) -> list[int]:
        return self.live.cached

    def forward(self, tokens):
        with self._lock:
            return self.live.forward(tokens)

    def truncate(self, n: int) -> None:
        with self._lock:
            self.live.truncate(n)


class LoggingDrafter:
    """Wraps a live drafter and logs every block it proposes: (prefix length, tokens, q ids).
    Used once per benchmark run to show a replayed session sends what a live one sends."""

    def __init__(self, live):
        self.live, self.log = live, []
        self.vocab_size, self.eos_token_ids = live.vocab_size, live.eos_token_ids

    def propose(self, committed, k, cfg, noise, q_entries) -> Block:
        block = draft_block(self.live, committed, k, cfg, noise, q_entries)
        self.log.append(fingerprint(committed, block))
        return block

    @property
    def cached(self) -> list[int]:
        return self.live.cached

    def forward(self, tokens):
        return self.live.forward(tokens)

    def truncate(self, n: int) -> None:
        self.live.truncate(n)


def fingerprint(committed: Sequence[int], block: Block) -> tuple:
    q = () if block.q is None else tuple(tuple(d.ids.tolist()) for d in block.q)
    return (len(committed), tuple(block.tokens), q)
