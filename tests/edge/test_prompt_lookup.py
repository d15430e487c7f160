"""edge.proposer.PromptLookupProposer: n-gram drafts from the committed text, the model's
otherwise; unit tests with a counting fake, and greedy equality on real parts."""

from __future__ import annotations

import asyncio

import pytest

from specsplit.edge.drafting import Block, DraftRule
from specsplit.edge.proposer import PromptLookupProposer, Proposer, lookup
from specsplit.shared.sampling import SamplingConfig

GREEDY = DraftRule(SamplingConfig(temperature=0.0), None)


class CountingModel(Proposer):
    """Proposes 900, 901, ... and counts what it was asked."""

    vocab_size, tokenizer_fingerprint, token_count, max_positions = 1000, "v1:x", 999, 64

    def __init__(self):
        self.asked: list[tuple[list[int], int]] = []

    def propose(self, committed, k, rule, stop=None) -> Block:
        self.asked.append((list(committed), k))
        return Block(list(range(900, 900 + k)), None)

    def guess_next(self, committed, rule, stop=None) -> int:
        return self.next_token(committed, rule, stop)[0]

    def next_token(self, committed, rule, stop=None):
        self.asked.append((list(committed), 1))
        return 900, None


def test_lookup_takes_what_followed_the_latest_earlier_occurrence_of_the_longest_suffix():
    #        0  1  2  3  4  5  6  7  8  9  10 11 12
    seq = [5, 1, 2, 3, 9, 9, 1, 2, 3, 8, 7, 1, 2, 3]
    assert lookup(seq, 2) == [8, 7]  # [1, 2, 3] last occurred at 6: 8, 7 followed
    assert lookup(seq, 9) == [8, 7, 1, 2, 3]  # up to the end of the sequence
    assert lookup([4, 1, 2, 3, 6, 0, 2, 3], 3, min_ngram=2) == [6, 0, 2]
    assert lookup([4, 1, 2, 3, 6, 0, 2, 3], 3) == []  # no earlier [0, 2, 3]: 3-grams only
    assert lookup([7, 7, 7, 7], 2) == [7]  # an overlapping occurrence counts
    assert lookup([1, 2], 4) == [] and lookup([], 4) == []
    # the longest suffix wins: [0, 1, 2, 3] occurred at 5, although [1, 2, 3] is later at 10
    assert lookup([9, 9, 9, 9, 9, 0, 1, 2, 3, 4, 6, 1, 2, 3, 5, 0, 1, 2, 3], 1) == [4]


def test_a_block_the_committed_text_predicts_costs_no_model_pass():
    model = CountingModel()
    proposer = PromptLookupProposer(model)
    committed = [10, 11, 12, 13, 14, 15, 20, 10, 11, 12]
    assert proposer.propose(committed, 3, GREEDY) == Block([13, 14, 15], None)
    assert model.asked == [] and proposer.lookups == [1, 3]
    assert proposer.next_token(committed, GREEDY) == (13, None)
    assert proposer.guess_next(committed, GREEDY) == 13 and model.asked == []
    assert (proposer.vocab_size, proposer.token_count, proposer.max_positions) == (1000, 999, 64)
    assert proposer.tokenizer_fingerprint == "v1:x"


def test_a_short_continuation_is_completed_by_the_model():
    model = CountingModel()
    proposer = PromptLookupProposer(model)
    committed = [10, 11, 12, 13, 10, 11, 12]  # [10, 11, 12] then 13, then the suffix itself
    assert proposer.propose(committed, 6, GREEDY).tokens == [13, 10, 11, 12, 900, 901]
    assert model.asked == [([*committed, 13, 10, 11, 12], 2)]


def test_no_match_or_sampling_drafts_with_the_model():
    model = CountingModel()
    proposer = PromptLookupProposer(model)
    assert proposer.propose([1, 2, 3, 4], 2, GREEDY).tokens == [900, 901]
    sampled = DraftRule(SamplingConfig(temperature=0.8), object())  # noise unused by the fake
    repeat = [10, 11, 12, 13, 10, 11, 12]
    assert proposer.propose(repeat, 2, sampled).tokens == [900, 901]
    assert proposer.next_token(repeat, sampled) == (900, None)
    assert len(model.asked) == 3 and proposer.lookups == [0, 0]
    assert proposer.propose(repeat, 0, GREEDY).tokens == []


@pytest.mark.parametrize("k", [1, 3, 6])
def test_a_checked_lookup_proposes_the_drafts_own_greedy_block(draft_exports, k):
    """Checked by the draft in one pass, a lookup keeps what the draft agrees with and then
    goes on as the draft: every block equals the model's own (here fp32, so no near-tie of a
    multi-row pass against one-row steps can flip a token)."""
    from specsplit.edge.onnx_drafter import OnnxDrafter
    from specsplit.edge.proposer import DraftModelProposer

    export = draft_exports["tied", "fp32"]
    checked = PromptLookupProposer(DraftModelProposer(OnnxDrafter(export)), checked=True)
    alone = DraftModelProposer(OnnxDrafter(export))
    base = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7]
    seqs = [base, [*base, 8, 9], [3, 4, 5, 200, 3, 4, 5], [1, 2, 3, 4]]
    for committed in seqs + seqs[::-1]:  # the cache rolls back and forth between them
        assert checked.propose(committed, k, GREEDY) == alone.propose(committed, k, GREEDY)
    assert checked.lookups[0] == 6  # all but [1, 2, 3, 4], twice
    assert checked.next_token(base, GREEDY) == alone.next_token(base, GREEDY)
    with pytest.raises(ValueError, match="needs a DraftModelProposer"):
        PromptLookupProposer(CountingModel(), checked=True)


@pytest.mark.slow
@pytest.mark.parametrize("checked", [False, True])
def test_greedy_split_with_prompt_lookup_equals_target_greedy(cloud, tiny, checked):
    """Real parts: lookups fire on a repetitive prompt, and the output is the target's own."""
    from specsplit.edge.client import GenerationConfig, SplitClient
    from specsplit.edge.onnx_drafter import OnnxDrafter
    from specsplit.edge.proposer import DraftModelProposer
    from specsplit.shared.tiny import reference_greedy

    prompt = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7]
    model = DraftModelProposer(OnnxDrafter(tiny.draft_onnx))
    proposer = PromptLookupProposer(model, checked=checked)

    async def run() -> list[int]:
        async with SplitClient(cloud.address, proposer) as client:
            for mode in ("lock-step", "cloud-led"):
                cfg = GenerationConfig(max_new_tokens=24, max_draft_tokens=4, session_mode=mode)
                out = await client.generate(prompt, cfg).collect()
                assert out == reference_greedy(tiny.target, prompt, 24), mode
        return proposer.lookups

    lookups = asyncio.run(run())
    assert lookups[0] >= 1, lookups


def test_a_draft_model_that_scores_blocks_drafts_behind_a_checked_lookup(draft_exports):
    """What SplitClient drafts with: the ONNX draft behind a checked lookup; a drafter that
    cannot score a block in one pass (a fake without all_logits) through the model alone; a
    Proposer as it is."""
    from specsplit.edge.onnx_drafter import OnnxDrafter
    from specsplit.edge.proposer import DraftModelProposer, as_proposer
    from tests.fakes import SlowDrafter

    onnx = as_proposer(OnnxDrafter(draft_exports["tied", "fp32"]))
    assert isinstance(onnx, PromptLookupProposer) and onnx.checked
    assert type(as_proposer(SlowDrafter())) is DraftModelProposer
    model = CountingModel()
    assert as_proposer(model) is model
