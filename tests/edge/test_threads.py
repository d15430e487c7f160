"""The drafter's default thread count follows the CPUs the process may use (edge/onnx_drafter.py
usable_cpus): ONNX Runtime's own default counts the machine's cores, so a drafter under taskset
or a container's CPU limit ran more spinning threads than it had cores."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import specsplit.edge.onnx_drafter as onnx_drafter
from specsplit.edge.onnx_drafter import OnnxDrafter, usable_cpus


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """A machine of 8 CPUs with the whole affinity mask and no cgroup quota, to narrow."""
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    root = tmp_path / "cgroup"
    root.mkdir()
    return root


def test_no_narrowing_leaves_onnx_runtimes_default(machine):
    assert usable_cpus(machine) is None
    (machine / "cpu.max").write_text("max 100000\n")
    assert usable_cpus(machine) is None


def test_an_affinity_mask_narrows_it(machine, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3}, raising=False)
    assert usable_cpus(machine) == 1


@pytest.mark.parametrize(("quota", "cpus"), [("150000 100000", 2), ("50000 100000", 1)])
def test_a_cgroup_v2_quota_narrows_it_rounded_up(machine, quota, cpus):
    (machine / "cpu.max").write_text(quota + "\n")
    assert usable_cpus(machine) == cpus


def test_a_cgroup_v1_quota_narrows_it(machine):
    (machine / "cpu").mkdir()
    (machine / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    (machine / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert usable_cpus(machine) == 3
    (machine / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")  # v1's "no quota"
    assert usable_cpus(machine) is None


def test_the_smaller_of_mask_and_quota_wins(machine, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    (machine / "cpu.max").write_text("200000 100000\n")
    assert usable_cpus(machine) == 2
    (machine / "cpu.max").write_text("700000 100000\n")
    assert usable_cpus(machine) == 4


def test_an_unreadable_quota_is_no_quota(machine):
    (machine / "cpu.max").write_text("garbage\n")
    assert usable_cpus(machine) is None


def test_the_drafter_runs_that_many_threads_unless_told(draft_exports, monkeypatch):
    model = draft_exports["tied", "fp32"]
    monkeypatch.setattr(onnx_drafter, "usable_cpus", lambda: 1)
    assert OnnxDrafter(model).threads == 1
    assert OnnxDrafter(model, threads=3).threads == 3
    monkeypatch.setattr(onnx_drafter, "usable_cpus", lambda: None)
    assert OnnxDrafter(model).threads is None


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux affinity masks")
def test_a_process_pinned_to_one_cpu_counts_one(tmp_path):
    """The real mask, as taskset sets it: a child pinned to one CPU of several."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one CPU: nothing to narrow")
    code = (
        "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))});"
        "from specsplit.edge.onnx_drafter import usable_cpus; print(usable_cpus())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1", out.stderr
