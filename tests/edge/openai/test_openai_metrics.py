"""The edge's metrics (edge.openai.metrics): vLLM's names and per-request shape, read back from
the Prometheus text they expose."""

from __future__ import annotations

from specsplit.edge.generation import GenerationStats
from specsplit.edge.openai.metrics import EdgeMetrics, commit_intervals, speculative_decoding
from specsplit.shared.spec_counts import StepCounts


def stats() -> GenerationStats:
    s = GenerationStats(route="split")
    for step in (StepCounts(3, 3, 4), StepCounts(3, 1, 2), StepCounts(0, 0, 1)):
        s.observe_step(step)
    s.ttft_s = 0.5
    s.token_times_s = [0.5] * 4 + [0.75] * 2 + [1.0]  # three rounds, three commits
    return s


def test_one_requests_figures_are_in_vllms_shape():
    assert speculative_decoding(stats()) == {
        "num_drafts": 2,
        "num_draft_tokens": 6,
        "num_accepted_tokens": 4,
        "num_accepted_tokens_per_pos": [2, 1, 1],
    }


def test_commits_of_one_round_are_one_interval():
    assert commit_intervals([0.5] * 4 + [0.75] * 2 + [1.0]) == [0.25, 0.25]
    assert commit_intervals([]) == [] and commit_intervals([1.0]) == []


def test_the_exposition_carries_vllms_names():
    m = EdgeMetrics()
    m.observe(stats(), prompt_tokens=9, generated=7, finish="length", started_s=0.25, e2e_s=1.5)
    text = m.exposition()[0].decode()
    for line in (
        "specsplit_edge_prompt_tokens_total 9.0",
        "specsplit_edge_generation_tokens_total 7.0",
        'specsplit_edge_request_success_total{finished_reason="length"} 1.0',
        "specsplit_edge_spec_decode_num_drafts_total 2.0",
        "specsplit_edge_spec_decode_num_draft_tokens_total 6.0",
        "specsplit_edge_spec_decode_num_accepted_tokens_total 4.0",
        'specsplit_edge_spec_decode_num_accepted_tokens_per_pos_total{position="0"} 2.0',
        "specsplit_edge_time_to_first_token_seconds_sum 0.75",  # the slot's wait + first commit
        "specsplit_edge_inter_token_latency_seconds_count 2.0",
        "specsplit_edge_e2e_request_latency_seconds_sum 1.5",
    ):
        assert line in text, line
