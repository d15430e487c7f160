"""What `make bench` runs, and in which order (bench/run.py's plan), without running it."""

from collections import Counter

import pytest

from bench.run import LTE, make_plan


def test_full_plan_runs_every_config_its_number_of_times():
    plan = make_plan(quick=False, max_new_tokens=None)
    runs = Counter(c for c, _ in plan.schedule())
    assert set(runs) == set(plan.configs())
    for cfg, n in runs.items():
        assert n == (plan.samples if cfg.temperature > 0 else plan.repeats)
    assert plan.samples >= 3 and plan.repeats >= 2
    assert sum(runs.values()) * len(plan.prompts) == plan.planned


def test_schedule_interleaves_the_modes_of_a_condition():
    """Sample j of every mode before sample j + 1 of any: a slow spell hits them alike."""
    plan = make_plan(quick=False, max_new_tokens=None)
    schedule = plan.schedule()
    for rtt, link, t in {(c.rtt_ms, c.link, c.temperature) for c in plan.configs()}:
        order = [(c, j) for c, j in schedule if (c.rtt_ms, c.link, c.temperature) == (rtt, link, t)]
        samples = [j for _, j in order]
        assert samples == sorted(samples), (rtt, link, t)
        first = {c.mode for c, j in order if j == 0}
        assert {"cloud-only", "lock-step", "cloud-led"} <= first, (rtt, link, t, first)


def test_auto_warm_runs_right_after_the_auto_run_whose_link_it_is_given():
    """auto-warm is auto on a new client given the link the cell's auto run just measured: the
    schedule must put that run (same condition, temperature and sample) right before it."""
    for quick in (False, True):
        schedule = make_plan(quick=quick, max_new_tokens=None).schedule()
        warm = [i for i, (c, _) in enumerate(schedule) if c.mode == "auto-warm"]
        assert warm, quick
        for i in warm:
            (c, j), (before, jb) = schedule[i], schedule[i - 1]
            assert before.mode == "auto" and jb == j
            assert (before.rtt_ms, before.link, before.temperature) == (
                c.rtt_ms,
                c.link,
                c.temperature,
            )


def test_a_plan_cut_to_some_conditions_keeps_only_theirs():
    """``--rtt 100 --rtt lte``: those cells, every mode and temperature, nothing else."""
    full = make_plan(quick=False, max_new_tokens=None)
    cut = full.only([100.0, "lte"])
    conditions = {(c.rtt_ms, c.link) for c in cut.configs() if c.mode != "edge-only"}
    assert conditions == {(100.0, ""), (LTE["rtt_ms"], "lte")}
    assert {c.mode for c in cut.configs()} == {c.mode for c in full.configs()}
    assert cut.samples == full.samples and cut.prompts == full.prompts
    with pytest.raises(SystemExit, match="not in this plan"):
        full.only([150.0])


def test_a_temperature_cut_keeps_every_mode_at_that_temperature():
    """``--quick --rtt 200 --temperature 0``: one short cell, every mode."""
    quick = make_plan(True, None)
    cut = quick.at([0.0])
    assert cut.temperatures == (0.0,)
    assert {c.mode for c in cut.configs()} == {c.mode for c in quick.configs()}
    with pytest.raises(SystemExit):
        quick.at([0.3])


def test_a_mode_cut_keeps_those_rows_of_every_cell():
    """``--rtt 500 --temperature 0 --mode cloud-only --mode auto --mode auto-warm``."""
    full = make_plan(False, None).only([500.0]).at([0.0])
    cut = full.modes_only(["cloud-only", "auto", "auto-warm"])
    assert [c.mode for c in cut.configs()] == ["cloud-only", "auto", "auto-warm"]
    assert cut.planned == 3 * full.repeats * len(full.prompts)
    with pytest.raises(SystemExit):
        full.modes_only(["fast"])
