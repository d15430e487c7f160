"""bench.contention: the table's ratios, bad cores refused before any process starts, and a small
real run whose neighbour processes are gone afterwards (no timing asserted)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.contention import NEIGHBOURS, main, measure, table


def test_the_table_gives_each_neighbour_against_the_idle_row():
    rows = [
        {"neighbour": "idle", "read_gb_s": 28.0, "product_ms": 60.0},
        {"neighbour": "compute", "read_gb_s": 26.6, "product_ms": 60.6},
        {"neighbour": "stream", "read_gb_s": 14.0, "product_ms": 63.0},
    ]
    out = table(rows).splitlines()
    assert out[2] == "| idle | 28.0 | 1.00 | 60.0 | 1.00 |"
    assert out[3] == "| compute | 26.6 | 0.95 | 60.6 | 1.01 |"
    assert out[4] == "| stream | 14.0 | 0.50 | 63.0 | 1.05 |"


def test_one_core_twice_or_a_core_outside_the_process_is_refused(capsys):
    with pytest.raises(ValueError, match="two different usable cores"):
        measure(0, 0)
    with pytest.raises(SystemExit) as e:
        main(["--victim", "0", "--neighbour", "4096"])
    assert e.value.code == 2 and "usable:" in capsys.readouterr().err


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two usable cores")
def test_a_small_run_measures_every_neighbour_and_stops_them():
    a, b = sorted(os.sched_getaffinity(0))[:2]
    before = set(os.listdir("/proc"))
    rows = measure(b, a, mib=8, repeats=1)
    assert [r["neighbour"] for r in rows] == list(NEIGHBOURS)
    assert all(r["read_gb_s"] > 0 and r["product_ms"] > 0 for r in rows)
    children = [
        p for p in set(os.listdir("/proc")) - before if p.isdigit() and _parent(p) == os.getpid()
    ]
    assert children == []


def _parent(pid: str) -> int | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(text[text.rindex(")") + 2 :].split()[1])
