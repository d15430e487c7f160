"""The cost curve and the block-size hint, with synthetic measurements."""

import pytest

from specsplit.cloud.capacity import (
    Acceptance,
    CostModel,
    StepTime,
    expected_tokens,
    max_draft_tokens_hint,
)


def curve(fn, rows=(1, 2, 4, 8, 16, 32, 64, 128, 256)) -> CostModel:
    cost = CostModel()
    for r in rows:
        cost.observe(r, fn(r))
    return cost


def test_cost_interpolates_and_extrapolates():
    cost = curve(lambda r: 100 + 2 * r)
    assert cost.cost(1) == pytest.approx(102)
    assert cost.cost(24) == pytest.approx(148)
    assert cost.cost(512) == pytest.approx(1124)


def test_one_stalled_pass_does_not_move_the_curve():
    cost = curve(lambda r: 10.0)
    for _ in range(4):
        cost.observe(8, 10.0)
    cost.observe(8, 5000.0)
    assert cost.cost(8) == pytest.approx(10.0)


def test_flat_cost_hints_the_largest_block():
    cost = curve(lambda r: 100.0)
    assert max_draft_tokens_hint(cost, 32, 0, 0, alpha=0.7, max_draft_tokens=16) == 16


def test_compute_bound_batch_gets_shorter_blocks():
    cost = curve(lambda r: 20 + 4 * r)
    one = max_draft_tokens_hint(cost, 1, 0, 0, alpha=0.8, max_draft_tokens=16)
    many = max_draft_tokens_hint(cost, 32, 0, 0, alpha=0.8, max_draft_tokens=16)
    assert many < one
    # Low acceptance shortens blocks further: each extra draft is less likely to pay.
    assert max_draft_tokens_hint(cost, 32, 0, 0, alpha=0.3, max_draft_tokens=16) <= many


def test_hint_is_never_worse_than_no_speculation():
    cost = curve(lambda r: r)  # purely compute-bound: every row costs the same
    k = max_draft_tokens_hint(cost, 8, 0, 0, alpha=0.5, max_draft_tokens=8)
    rate = lambda k: 8 * expected_tokens(0.5, k) / cost.cost(8 * (k + 1))  # noqa: E731
    assert rate(k) >= 0.95 * max(rate(j) for j in range(9))
    assert rate(k) >= 0.95 * rate(0)


def test_a_stale_stall_does_not_stop_drafting_for_good():
    cost = CostModel(stale_after=50)
    for r in (1, 4, 16, 64):
        for _ in range(3):
            cost.observe(r, 100.0)
    for _ in range(15):  # contention: passes of more than one row took 50 times as long
        for r in (4, 16, 64):
            cost.observe(r, 5000.0)
    hints = []
    for _ in range(120):  # the hint forbids drafting, so only one-row passes run
        hints.append(max_draft_tokens_hint(cost, 1, 0, 0, alpha=0.7, max_draft_tokens=16))
        cost.observe(1 + hints[-1], 100.0 if hints[-1] == 0 else 90.0)
    assert hints[0] == 0
    # Probes came, one per stale period: the first one's quick pass began to mend the median.
    assert 1 <= hints.count(16) <= 3
    for _ in range(15):  # the stall is over: passes of any size are cheap again
        for r in (4, 16, 64):
            cost.observe(r, 100.0)
    assert max_draft_tokens_hint(cost, 1, 0, 0, alpha=0.7, max_draft_tokens=16) == 16


def test_acceptance_estimate_follows_rounds():
    acc = Acceptance()
    for _ in range(300):
        acc.observe(3, 4)  # 3 accepted then a rejection: a = 3/4
    assert acc.rate == pytest.approx(0.75, abs=0.01)
    for _ in range(300):
        acc.observe(4, 4)
    assert acc.rate > 0.95


def test_step_time_reports_plain_passes_until_rows_have_a_cost():
    steps = StepTime()
    assert steps.ms == 0.0  # nothing measured: Started.step_ms says "unknown"
    for ms in (500.0, 520.0, 540.0):
        steps.observe(9, 0, ms)
    assert steps.ms == 520.0  # one size seen: no scale (errs towards lock-step)


def test_step_time_scales_passes_to_one_row_where_rows_cost_time():
    """A CPU target: 9 rows cost 1.8x one row. Lock-step passes of 9 rows then count as the
    one-row step a lead would take, not as the 9-row pass."""
    steps = StepTime()
    for _ in range(5):
        steps.observe(1, 0, 290.0)
        steps.observe(9, 0, 522.0)
    for _ in range(20):
        steps.observe(9, 0, 522.0)
    assert steps.ms == pytest.approx(290.0, rel=0.02)


def test_step_time_keeps_the_other_sessions_rows_of_a_batch():
    """Under load a step is the batch's pass: only this session's part shrinks to one row."""
    steps = StepTime()
    for rows in (1, 16, 32):
        steps.observe(rows, 0, 100.0 + 10.0 * rows)  # 10 ms per row past a 100 ms floor
    steps.recent.clear()
    steps.observe(9, 32, 420.0)  # 23 rows of others + 9 of ours
    assert steps.ms == pytest.approx(100.0 + 10.0 * 24, rel=0.02)  # the pass over 24 rows


def test_step_time_is_the_pass_itself_where_rows_are_free():
    """A GPU target reads every weight once whatever the rows: the scale stays near 1."""
    steps = StepTime()
    for rows in (1, 4, 9):
        for _ in range(3):
            steps.observe(rows, 0, 20.0)
    assert steps.ms == pytest.approx(20.0)


def test_hint_of_no_drafts_does_not_last_for_good():
    """A compute-bound target (rows cost time) and early rejections make the hint ask for no
    drafts; the passes that follow carry none, so no verdict can raise the estimate. Those idle
    passes pull it back to the prior, and within a few the hint asks for drafts again."""
    cost = CostModel()
    for rows, ms in ((1, 140.0), (2, 190.0), (4, 250.0), (8, 420.0), (16, 760.0)):
        for _ in range(3):
            cost.observe(rows, ms)
    acc = Acceptance()
    for _ in range(15):
        acc.observe(0, 4)  # blocks rejected outright, one after another
    hints = [max_draft_tokens_hint(cost, 1, 0, 0, acc.rate, max_draft_tokens=16)]
    while hints[-1] == 0 and len(hints) < 50:
        acc.idle()  # the pass the hint asked for: this session drafted nothing
        hints.append(max_draft_tokens_hint(cost, 1, 0, 0, acc.rate, max_draft_tokens=16))
    assert hints[0] == 0
    assert 1 < len(hints) <= 6 and hints[-1] > 0
