"""Where a stream's drafts come from: the ``Proposer`` seam the mode loops draft through.

The loops (edge.lockstep, edge.cloud_led) ask a ``Proposer`` for drafts under the stream's
``DraftRule`` and know nothing of how they are made: ``DraftModelProposer`` runs the draft model
(a ``Drafter``, edge.drafting); ``PromptLookupProposer`` takes a block from the committed text
where it predicts one (n-gram prompt lookup), the model's otherwise; the load benchmark's
``bench.replay.ReplayDrafter`` serves recorded blocks instead. Implementations name ``Proposer``
as a base class: that, not the methods they happen to have, is what ``as_proposer`` goes by.

Every method may run in a worker thread (edge.worker): given ``stop``, it gives up (``Stopped``)
at its next forward pass once ``stop`` is set.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from specsplit.edge.drafting import (
    Alternative,
    Block,
    Drafter,
    DraftRule,
    alternative,
    cached_prefix,
    draft_block,
    draw_next,
    greedy_after,
    next_logits,
)
from specsplit.edge.worker import Stoppable, Worker
from specsplit.shared.sampling import SparseDist


class Proposer(Protocol):
    vocab_size: int
    # What the pairing check at Start reads (edge.rounds): the draft tokenizer's fingerprint
    # (shared.tokenizer_fingerprint; None: not known) and the ids it may propose, [0, count).
    tokenizer_fingerprint: str | None = None
    token_count: int | None = None
    # The longest context the draft runs (edge.onnx_drafter's max_positions; None: no limit
    # known): a longer prompt is refused before its session starts (edge.client).
    max_positions: int | None = None

    def propose(
        self, committed: Sequence[int], k: int, rule: DraftRule, stop: threading.Event | None = None
    ) -> Block:
        """k draft tokens after ``committed`` (fewer only where a replay has none to give)."""
        ...

    def guess_next(
        self, committed: Sequence[int], rule: DraftRule, stop: threading.Event | None = None
    ) -> int:
        """The token the cloud draws itself after ``committed``, as the draft guesses it (the
        bonus a draft-ahead bets on); any token no verdict can match when it has no guess."""
        ...

    def next_token(
        self, committed: Sequence[int], rule: DraftRule, stop: threading.Event | None = None
    ) -> tuple[int, SparseDist | None]:
        """One draft token after ``committed`` and the q it was drawn from (None when greedy):
        how a cloud-led speculation grows."""
        ...

    def next_token_with_alternative(
        self, committed: Sequence[int], rule: DraftRule, stop: threading.Event | None = None
    ) -> tuple[int, SparseDist | None, Alternative | None]:
        """``next_token`` and, when greedy, the draft's second choice there (what a cloud-led
        speculation branches on); None where the proposer has none (this default)."""
        token, q = self.next_token(committed, rule, stop)
        return token, q, None

    def interrupt(self) -> None:
        """Cuts short a forward pass a worker thread is running for a token nobody needs any
        more (its worker's ``stop`` is set already); nothing where the proposer cannot (this
        default)."""

    def feeds(self, committed: Sequence[int]) -> int:
        """Tokens a draw after ``committed`` forwards before its token: what the draft's cache
        lacks of it (the ones an interrupted pass would have to forward again); 1 where the
        proposer keeps no cache (this default)."""
        return 1


class DraftModelProposer(Proposer):
    """Drafts with the draft model itself: edge.drafting over a ``Drafter``."""

    def __init__(self, drafter: Drafter):
        self.drafter = drafter
        self.vocab_size = drafter.vocab_size
        self.tokenizer_fingerprint = getattr(drafter, "tokenizer_fingerprint", None)
        self.token_count = getattr(drafter, "token_count", None)
        self.max_positions = getattr(drafter, "max_positions", None)

    def _model(self, stop: threading.Event | None) -> Drafter:
        return self.drafter if stop is None else Stoppable(self.drafter, stop)

    def interrupt(self) -> None:
        if (cut := getattr(self.drafter, "interrupt", None)) is not None:
            cut()

    def feeds(self, committed) -> int:
        return len(committed) - cached_prefix(self.drafter, committed)

    def propose(self, committed, k, rule, stop=None) -> Block:
        model = self._model(stop)
        return draft_block(
            model, committed, k, rule.sampling, rule.noise, rule.q_entries, rule.q_levels
        )

    def guess_next(self, committed, rule, stop=None) -> int:
        """The top token when greedy, else the draft's own draw from q with the numbers the
        cloud's draw at that position shares (shared/coupling.py); the two agree with
        probability >= (1 - TV) / (1 + TV), where the top token would match a sampled bonus only
        with probability p(top)."""
        return self.next_token(committed, rule, stop)[0]

    def next_token(self, committed, rule, stop=None) -> tuple[int, SparseDist | None]:
        logits = next_logits(self._model(stop), committed)
        pos = len(committed)
        return draw_next(logits, pos, rule.sampling, rule.noise, rule.q_entries, rule.q_levels)

    def next_token_with_alternative(self, committed, rule, stop=None):
        logits = next_logits(self._model(stop), committed)  # [V]
        if not rule.sampling.greedy:  # a sampled token has no second choice to branch on
            pos = len(committed)
            token, q = draw_next(
                logits, pos, rule.sampling, rule.noise, rule.q_entries, rule.q_levels
            )
            return token, q, None
        return int(np.argmax(logits)), None, alternative(logits)


def as_proposer(source: Drafter | Proposer) -> Proposer:
    """A ``Proposer`` (an instance of a class that names it as a base) as it is; a draft model
    drafts through ``DraftModelProposer``, behind a checked ``PromptLookupProposer`` where its
    ``forward`` can score a block in one pass (``all_logits``: edge.onnx_drafter): where the
    committed text predicts a block, the draft checks it in one pass instead of k steps, and
    the block stays the draft's own greedy one."""
    if Proposer in type(source).__mro__:
        return source
    model = DraftModelProposer(source)
    if "all_logits" in inspect.signature(source.forward).parameters:
        return PromptLookupProposer(model, checked=True)
    return model


def timed_block(
    proposer: Proposer,
    committed: Sequence[int],
    k: int,
    rule: DraftRule,
    stop: threading.Event | None = None,
) -> tuple[Block, float]:
    """A block of k after ``committed`` and the time it took (ms). The generator depends only on
    the prefix length, so a block drafted ahead for a guessed prefix equals the one drafted
    after the verdict confirms it."""
    t0 = time.perf_counter()
    block = proposer.propose(committed, k, rule, stop)
    return block, (time.perf_counter() - t0) * 1e3


async def block_off_loop(
    proposer: Proposer, committed: Sequence[int], k: int, rule: DraftRule
) -> tuple[Block, float]:
    """``timed_block`` in a worker thread: the event loop, and with it the streams of every
    other generation in this process (`specsplit-edge serve`'s), goes on meanwhile."""
    worker = Worker(timed_block, proposer, committed, k, rule)
    try:
        return await worker.result()
    finally:
        await worker.join()


def draft_ahead(
    proposer: Proposer, seq: list[int], k: int, rule: DraftRule, stop: threading.Event
) -> tuple[int, Block]:
    """Runs in a worker thread while the verdict on ``seq``'s drafts is in flight: guesses the
    bonus and drafts the block after it."""
    guess = proposer.guess_next(seq, rule, stop)
    return guess, proposer.propose([*seq, guess], k, rule, stop)


# For callers with no stream (tools, tests): ``parts`` are the DraftRule's fields, in order ---


def propose(source: Drafter | Proposer, committed: Sequence[int], k: int, *parts) -> Block:
    return as_proposer(source).propose(committed, k, DraftRule(*parts))


def guess_next(source: Drafter | Proposer, committed: Sequence[int], *parts) -> int:
    return as_proposer(source).guess_next(committed, DraftRule(*parts))


class PromptLookupProposer(Proposer):
    """Prompt lookup (n-gram) drafting beside a model's: where the committed sequence ends with
    an n-gram (n in [MIN_NGRAM, MAX_NGRAM], the longest first) that occurred before in it, the
    block is what followed its latest earlier occurrence (code edits and quotes repeat their
    context); that costs no forward pass. A continuation shorter than k is completed by
    ``model``; with no match, or when sampling (a lookup has no q to send), ``model`` drafts.

    ``checked`` (``model`` a ``DraftModelProposer``): the draft model checks the lookup in one
    pass over it (edge.drafting.greedy_after) and the block keeps it up to where the draft's own
    top token differs, takes that token, and continues as the model would: the draft's greedy
    block, so a lookup never proposes what the draft would not, for one pass instead of k.

    Lossless as any draft is: the cloud verifies whatever is proposed (greedy output equals the
    target's). ``lookups``: blocks drafted with a lookup, and the tokens the lookup gave them
    (checked: those the draft agreed with)."""

    def __init__(self, model: Proposer, min_ngram: int | None = None, checked: bool = False):
        if checked and not isinstance(model, DraftModelProposer):
            raise ValueError("a checked prompt lookup needs a DraftModelProposer to check it")
        self.model, self.checked = model, checked
        self.min_ngram = MIN_NGRAM if min_ngram is None else min_ngram
        self.vocab_size = model.vocab_size
        self.tokenizer_fingerprint = model.tokenizer_fingerprint
        self.token_count = model.token_count
        self.max_positions = model.max_positions
        self.lookups = [0, 0]  # blocks, tokens proposed by lookup

    def propose(self, committed, k, rule, stop=None) -> Block:
        found = lookup(committed, k, self.min_ngram) if rule.sampling.greedy and k > 0 else []
        if not found:
            return self.model.propose(committed, k, rule, stop)
        self.lookups[0] += 1
        if self.checked:
            top = greedy_after(self.model._model(stop), committed, found)  # [len(found) + 1]
            agree = 0
            while agree < len(found) and found[agree] == top[agree]:
                agree += 1
            self.lookups[1] += agree
            found = [*found[:agree], int(top[agree])][:k]  # the draft's own greedy tokens
        else:
            self.lookups[1] += len(found)
        if len(found) == k:
            return Block(found, None)
        rest = self.model.propose([*committed, *found], k - len(found), rule, stop)
        return Block(found + rest.tokens, None)

    def guess_next(self, committed, rule, stop=None) -> int:
        return self.next_token(committed, rule, stop)[0]

    def next_token(self, committed, rule, stop=None) -> tuple[int, SparseDist | None]:
        found = lookup(committed, 1, self.min_ngram) if rule.sampling.greedy else []
        if found and not self.checked:  # checked: a one-token check is the model's own step
            return found[0], None
        return self.model.next_token(committed, rule, stop)

    def next_token_with_alternative(self, committed, rule, stop=None):
        found = lookup(committed, 1, self.min_ngram) if rule.sampling.greedy else []
        if found and not self.checked:  # a lookup knows no second choice
            return found[0], None, None
        return self.model.next_token_with_alternative(committed, rule, stop)

    def interrupt(self) -> None:
        self.model.interrupt()

    def feeds(self, committed) -> int:
        return self.model.feeds(committed)


MAX_NGRAM = 4  # the longest suffix looked up (longer matches predict better) ...
MIN_NGRAM = 3  # ... down to this: shorter ones match by chance (a newline, a comma)


def lookup(committed: Sequence[int], k: int, min_ngram: int = MIN_NGRAM) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of
    ``committed`` of MAX_NGRAM..min_ngram tokens; [] when none occurred."""
    seq = np.asarray(committed, dtype=np.int64)
    for n in range(min(MAX_NGRAM, len(seq) - 1), min_ngram - 1, -1):
        suffix = seq[-n:]
        # starts j < len - n of earlier windows equal to the suffix, the latest first
        starts = np.flatnonzero(seq[: len(seq) - n] == suffix[0])[::-1]
        for j in starts:
            if np.array_equal(seq[j : j + n], suffix):
                return [int(t) for t in seq[j + n : j + n + k]]
    return []
