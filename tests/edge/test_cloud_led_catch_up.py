"""A cloud-led draw that catches up (forwards tokens the draft's cache lacks) is not cut short
when a Verdict commits past its prefix without rejecting any of it: cut, the pass caches
nothing, and where it takes longer than the cloud's step every Verdict cut it again, so the edge
never drafted. A short draw a Verdict passed is still cut. A first block the cloud committed past
while the draft was still loading stops after its prefill. The loop against a scripted far end
(tests.edge.fake_cloud) stepping every 20 ms or sooner."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence

import numpy as np

from specsplit.edge.cloud_led import CATCH_UP, cloud_led_rounds
from specsplit.edge.drafting import Interrupted
from specsplit.edge.proposer import DraftModelProposer, timed_block
from specsplit.edge.worker import Worker
from specsplit.shared.session_mode import SessionMode
from tests.edge.fake_cloud import (
    GREEDY,
    PROMPT,
    VOCAB,
    FakeCloudStream,
    committed,
    expected,
    plan,
    target,
)

PASS_S, TOKEN_S = 0.004, 0.006  # a pass: 4 ms, plus 6 ms a token it forwards


class CatchingUpDrafter:
    """Drafts ``target`` by position; a pass takes PASS_S + TOKEN_S a token, unless
    ``interrupt()`` cuts it short (as OnnxDrafter's): then it raises Interrupted and caches
    nothing."""

    def __init__(self) -> None:
        self.vocab_size, self.eos_token_ids = VOCAB, ()
        self._cached: list[int] = []
        self.cut = threading.Event()
        self.fed: list[int] = []  # tokens each finished pass forwarded ...
        self.cut_short: list[int] = []  # ... and each pass cut short

    @property
    def cached(self) -> list[int]:
        return list(self._cached)

    def truncate(self, n: int) -> None:
        del self._cached[n:]

    def interrupt(self) -> None:
        self.cut.set()

    def forward(self, tokens: Sequence[int]) -> np.ndarray:
        self.cut.clear()
        if self.cut.wait(PASS_S + TOKEN_S * len(tokens)):
            self.cut_short.append(len(tokens))
            raise Interrupted("cut short")
        start = len(self._cached)
        self._cached += list(tokens)
        self.fed.append(len(tokens))
        logits = np.zeros((len(tokens), VOCAB), dtype=np.float32)
        for i in range(len(tokens)):
            logits[i, target(start + i + 1)] = 5.0
        return logits


def _run(new_tokens: int) -> tuple[list[int], FakeCloudStream, CatchingUpDrafter]:
    stream, seq = FakeCloudStream(new_tokens, SessionMode.CLOUD_LED), committed()
    drafter = CatchingUpDrafter()
    rounds = cloud_led_rounds(
        stream,
        seq,
        DraftModelProposer(drafter),
        GREEDY,
        plan(SessionMode.CLOUD_LED),
        stream.started_message(),
    )

    async def run():
        return [c async for c in rounds]

    return sum(asyncio.run(run()), []), stream, drafter


def test_feeds_counts_what_the_drafts_cache_lacks():
    drafter = CatchingUpDrafter()
    proposer = DraftModelProposer(drafter)
    assert proposer.feeds([1, 2, 3, 4, 5]) == 5  # nothing cached
    drafter.forward([1, 2, 3])
    assert proposer.feeds([1, 2, 3, 4, 5]) == 2
    assert proposer.feeds([1, 2, 3]) == 1  # the last token is always fed, for its logits
    assert proposer.feeds([1, 9, 3, 4]) == 3  # past where the cache diverges
    assert proposer.feeds([]) == 0  # nothing to feed (no IndexError on the cached tokens)


def test_a_prefill_longer_than_the_clouds_step_runs_on_and_the_edge_drafts():
    # The prompt's prefill forwards len(PROMPT) tokens (28 ms) against steps of 20 ms or less:
    # each Verdict commits past it. Cut short every time, the edge never drafted a token.
    assert len(PROMPT) >= CATCH_UP and PASS_S + TOKEN_S * len(PROMPT) > 0.02
    tokens, stream, drafter = _run(40)
    assert tokens == expected(40)
    assert drafter.fed and drafter.fed[0] >= len(PROMPT)  # the prefill ran to its end
    assert all(n < CATCH_UP for n in drafter.cut_short)  # no catch-up was cut
    assert stream.stats.accepted > 0  # Drafts came in time to be verified
    assert stream.stats.accepted == stream.stats.drafted  # the draft is the target


def test_a_short_draw_the_cloud_passed_is_still_cut():
    # Once caught up each pass forwards one token (10 ms); a Verdict that commits the bonus after
    # a speculation's last token passes such a draw's prefix: it is cut, not run out.
    _, stream, drafter = _run(60)
    assert 0 < len(drafter.cut_short) <= stream.stats.interrupted


LATE_S = 0.3  # a draft session still loading at Start: fifteen of the far end's 20 ms steps
EARLY_K = 4  # the first block's length (edge.rounds.FIRST_BLOCK)


class LateDrafter(CatchingUpDrafter):
    """Its first pass, the prompt's prefill, comes LATE_S late (a new process's session loads)."""

    def forward(self, tokens: Sequence[int]) -> np.ndarray:
        if not self.fed and not self.cut_short:
            time.sleep(LATE_S)
        return super().forward(tokens)


def test_a_first_block_the_cloud_committed_past_stops_after_its_prefill():
    # The cloud committed more than the block's EARLY_K tokens on its own while the draft
    # loaded: the block's draft steps would all be stale. Its prefill (the draft's cache) is
    # kept; the next pass forwards what the cloud committed, and the speculation goes on from it.
    stream, seq = FakeCloudStream(40, SessionMode.CLOUD_LED), committed()
    drafter = LateDrafter()
    proposer = DraftModelProposer(drafter)

    async def run():
        early = Worker(timed_block, proposer, list(seq.tokens), EARLY_K, GREEDY)
        started = stream.started_message()
        rounds = cloud_led_rounds(
            stream,
            seq,
            proposer,
            GREEDY,
            plan(SessionMode.CLOUD_LED),
            started,
            None,
            early,
            EARLY_K,
        )
        return [c async for c in rounds]

    tokens = sum(asyncio.run(run()), [])
    assert tokens == expected(40)
    assert drafter.fed[0] == len(PROMPT)  # the prefill ran to its end ...
    assert drafter.fed[1] > EARLY_K  # ... then a catch-up, not the block's one-token steps
    assert stream.stats.accepted > 0  # the speculation after it was verified
