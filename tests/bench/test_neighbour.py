"""bench.neighbour: the table's ratios, bad arguments refused, the drafting neighbour (a real ONNX
draft process) ready and then stopped, and a small run against the real tiny cloud that times
every pass with the neighbour idle and drafting and leaves no neighbour behind (no timing
asserted)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.neighbour import _drafting, main, measure, table


def test_the_table_gives_the_drafting_row_against_the_idle_one():
    result = {
        "idle": {"pass_ms": [40.0, 41.0, 42.0], "tok_s": [17.0, 17.6]},
        "drafting": {"pass_ms": [49.0, 50.0, 51.0], "tok_s": [15.3, 14.9]},
    }
    out = table(result).splitlines()
    assert out[2] == "| idle | 41.0 | 1.00 | 17.30 | 1.00 |"
    assert out[3] == "| drafting | 50.0 | 1.22 | 15.10 | 0.87 |"


@pytest.mark.parametrize("flag", ["--rounds", "--max-new-tokens"])
def test_nothing_below_one_is_accepted(flag, capsys):
    with pytest.raises(SystemExit) as e:
        main([flag, "0"])
    assert e.value.code == 2 and "must be >= 1" in capsys.readouterr().err


def test_the_drafting_neighbour_drafts_then_stops(tiny):
    core = min(os.sched_getaffinity(0))
    proc = _drafting(tiny.draft_onnx, core, [1, 2, 3], steps=4)
    try:
        assert proc.poll() is None  # said ready, still drafting
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode is not None


def test_a_small_run_against_the_real_cloud_times_passes_beside_both_neighbours(cloud, tiny):
    core = min(os.sched_getaffinity(0))
    before = _draft_processes()
    prompts = [{"prompt_ids": [1, 2, 3, 4]}]
    result = measure(
        cloud.address, tiny.draft_onnx, core, prompts, rounds=1, max_new=4, log=lambda _: None
    )
    for kind in ("idle", "drafting"):
        assert len(result[kind]["pass_ms"]) >= 3 and all(ms > 0 for ms in result[kind]["pass_ms"])
        assert len(result[kind]["tok_s"]) == 1 and result[kind]["tok_s"][0] > 0
    assert _draft_processes() == before


def _draft_processes() -> set[int]:
    """This user's processes running the drafting neighbour's code."""
    pids = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"drafter.next_token" in cmd:
            pids.add(int(pid))
    return pids
