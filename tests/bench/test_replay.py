"""Replayed drafts equal live drafts: blocks of any k, and the draft-ahead guess, with a fake
deterministic drafter (logits a function of the prefix)."""

import numpy as np
import pytest

from bench.replay import K_MAX, ReplayDrafter
from specsplit.edge.drafting import draft_block
from specsplit.edge.proposer import guess_next, propose
from specsplit.shared.coupling import SharedNoise
from specsplit.shared.sampling import SamplingConfig

V = 50


class HashDrafter:
    vocab_size, eos_token_ids = V, ()

    def __init__(self):
        self.cached: list[int] = []

    def forward(self, tokens):
        out = []
        for t in tokens:
            self.cached.append(int(t))
            rng = np.random.default_rng(hash(tuple(self.cached)) % 2**32)
            out.append(rng.normal(size=V) * 3)
        return np.stack(out)

    def truncate(self, n):
        del self.cached[n:]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_replayed_blocks_and_guesses_equal_live(temperature):
    cfg = SamplingConfig(temperature=temperature)
    replay = ReplayDrafter(HashDrafter(), greedy=temperature == 0)
    live = HashDrafter()
    prefix = [1, 2, 3]
    noise = SharedNoise(7, V)
    replay.record(prefix, cfg, noise, 16)
    for k in range(K_MAX + 1):
        got = propose(replay, prefix, k, cfg, noise, 16)
        want = draft_block(live, prefix, k, cfg, noise, 16)
        assert got.tokens == want.tokens
        if temperature:
            assert [q.ids.tolist() for q in got.q] == [q.ids.tolist() for q in want.q]
        # the draft-ahead guess after the block comes from the recording, not the live model
        seq = [*prefix, *want.tokens]
        assert guess_next(replay, seq, cfg, noise, 16) == guess_next(live, seq, cfg, noise, 16)
    assert replay.misses == 0


def test_greedy_miss_is_an_empty_block_never_a_live_draft():
    replay = ReplayDrafter(HashDrafter(), greedy=True)
    block = propose(replay, [4, 5], 3, SamplingConfig(), None, 16)
    assert block.tokens == [] and replay.off_path == 1
    assert guess_next(replay, [4, 5], SamplingConfig(), None, 16) == -1
