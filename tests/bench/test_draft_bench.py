"""bench.draft_agreement and bench.draft_prefill without a model: a fake drafter whose top
token is a known function of the text so far, and a hand-written ONNX Runtime profile."""

from __future__ import annotations

import json

import numpy as np

from bench.draft_agreement import agreement, rare_id, step_times
from bench.draft_prefill import op_times, step_ms, target_prefill_s

VOCAB = 16


class FakeDrafter:
    """Top token after a sequence: (its last token + 1) % VOCAB (OnnxDrafter's contract)."""

    def __init__(self) -> None:
        self._tokens: list[int] = []

    @property
    def cached(self) -> list[int]:
        return list(self._tokens)

    def forward(self, tokens, all_logits: bool = False) -> np.ndarray:
        self._tokens += list(tokens)
        rows = np.zeros((len(tokens), VOCAB), np.float32)  # [len(tokens), vocab]
        rows[np.arange(len(tokens)), (np.asarray(tokens) + 1) % VOCAB] = 1.0
        return rows if all_logits else rows[-1:]

    def truncate(self, n: int) -> None:
        del self._tokens[n:]

    def reset(self) -> None:
        self._tokens = []


def test_agreement_is_the_fraction_of_the_targets_tokens_the_draft_tops_teacher_forced():
    prompts = [("code", [1, 2, 3]), ("prose", [5])]
    # code: the draft predicts 4, 5, 6 after 3, 4, 5 (teacher-forced on the target's text)
    continuations = [[4, 5, 9, 10], [6, 0]]  # code: 4 and 5 right, 9 and 10 wrong (6, 10 next)
    drafter = FakeDrafter()
    assert agreement(drafter, prompts, continuations) == {"code": 0.75, "prose": 0.5}
    assert drafter.cached == []


def test_step_times_leave_every_drafter_empty_and_time_every_step():
    drafters = [FakeDrafter(), FakeDrafter()]
    times = step_times(drafters, steps=3, rounds=2, context=[1, 2, 3])
    assert len(times) == 2 and all(cpu >= 0 and wall >= 0 for cpu, wall in times)
    assert all(d.cached == [] for d in drafters)


def test_step_ms_leaves_the_cache_as_it_was():
    drafter = FakeDrafter()
    drafter.forward([7, 8])
    step_ms(drafter, steps=4)
    assert drafter.cached == [7, 8]


def test_op_times_sum_node_kernel_events_per_operator(tmp_path):
    events = [
        {"cat": "Node", "name": "a_kernel_time", "dur": 1500, "args": {"op_name": "MatMul"}},
        {"cat": "Node", "name": "b_kernel_time", "dur": 500, "args": {"op_name": "MatMul"}},
        {"cat": "Node", "name": "c_kernel_time", "dur": 3000, "args": {"op_name": "Softmax"}},
        {"cat": "Node", "name": "c_fence_before", "dur": 9000, "args": {"op_name": "Softmax"}},
        {"cat": "Session", "name": "model_run", "dur": 99000, "args": {}},
    ]
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(events))
    assert op_times(profile) == {"Softmax": 3.0, "MatMul": 2.0}


def test_every_gemm_format_computes_the_linear():
    """bench.draft_gemm times what it claims: each format's one-node graph is x @ W.T, to its
    quantisation's precision."""
    from bench.draft_gemm import FORMATS, gemm_session

    rng = np.random.default_rng(0)
    weight = rng.standard_normal((64, 256)).astype(np.float32) * 0.02  # [n, k]
    x = rng.standard_normal((1, 5, 256)).astype(np.float32)  # [1, m, k]
    ref = x @ weight.T
    for label, *fmt in FORMATS:
        y = gemm_session(weight, *fmt).run(None, {"x": x})[0]
        error = np.sqrt(np.mean((y - ref) ** 2) / np.mean(ref**2))  # a wrong layout: ~1.4
        assert error < 0.2, (label, error)


def test_draft_slots_prints_both_ways_for_each_count(tiny, capsys):
    """bench.draft_slots on the tiny draft (real ONNX Runtime, a process per configuration):
    a row per way and count, the shared one as one session."""
    from bench.draft_slots import main

    args = ["--draft", str(tiny.draft_onnx), "--slots", "1", "--slots", "2"]
    assert main(args + ["--prompt", "5", "--steps", "3", "--repeats", "1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [row[:2] for row in rows] == [["1", "1"], ["2", "2"], ["2", "1"]]
    for row in rows:
        assert float(row[2]) > 0 and float(row[3]) > 0 and len(row) == 4 + int(row[0])


def test_rare_id_is_outside_a_split_heads_rows(tmp_path):
    assert rare_id(tmp_path) is None  # no lm_head_ids.npy: one head over every id
    np.save(tmp_path / "lm_head_ids.npy", np.array([0, 1, 2, 4, 5]))
    assert rare_id(tmp_path) == 3
    np.save(tmp_path / "lm_head_ids.npy", np.array([0, 1, 2]))
    assert rare_id(tmp_path) == 3


def test_target_prefill_times_a_served_prefill(tiny):
    """The target's prefill as ``serve`` loads it (the tiny target): a 40-token prompt, warmed
    on its first 16, timed in wall and CPU seconds."""
    wall, cpu = target_prefill_s([(7 * i) % 50 + 3 for i in range(40)], 1, tiny.target)
    assert 0 < wall < 60 and 0 < cpu < 60
