"""Every generated benchmark page carries its date, commit and CPU (bench/stamp.py, issue 41)."""

import collections
import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

from bench import soak, stamp
from bench.load_report import write_load_report
from bench.stamp import stamp_line

REPO = Path(__file__).resolve().parents[2]
MEASURED = {"date": "2026-01-02 03:04 UTC", "commit": "abc1234", "cpu": "Some CPU"}
LINE = "Measured 2026-01-02 03:04 UTC at commit `abc1234` on Some CPU."


def test_the_commit_is_the_checkouts_short_head():
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    assert head and stamp.commit(REPO) == head


def test_outside_a_checkout_the_commit_is_unknown(tmp_path):
    assert stamp.commit(tmp_path) == "unknown"
    assert stamp.commit(tmp_path / "gone") == "unknown"


def test_the_cpu_is_the_kernels_cpu_model(monkeypatch):
    from specsplit.cloud.engine import kernel_library

    monkeypatch.setattr(kernel_library, "cpu_model", lambda: "Some CPU")
    assert stamp.cpu_model() == "Some CPU"
    assert stamp.stamp()["cpu"] == "Some CPU"


def test_a_stamp_names_date_commit_and_cpu_and_what_an_older_run_lacks():
    assert stamp_line(MEASURED) == LINE
    assert stamp_line({"date": "today"}) == "Measured today at commit `unknown` on unknown."
    assert set(stamp.stamp()) == {"date", "commit", "cpu"}


def test_the_load_page_is_stamped(tmp_path):
    row = {
        "mode": "split",
        "temperature": 0.0,
        "sessions": 1,
        "token_times_s": [0.1, 0.2],
        "ttft_s": 0.1,
        "batch_sessions": [1],
        "batch_rows": [2],
        "new_tokens": 2,
        "rounds": 1,
        "block_hint": [4],
        "drafted": 4,
    }
    raw, meta = tmp_path / "l-raw.jsonl", tmp_path / "l-meta.json"
    raw.write_text(json.dumps(row) + "\n")
    plan = {"window_s": 1.0, "prompts": 1, "max_new_tokens": 2}
    cores = {"cloud_cores": [1], "edge_cores": [0], "k": 4}
    meta.write_text(json.dumps(MEASURED | cores | {"target": "/t", "draft": "/d", "plan": plan}))
    assert LINE in write_load_report(raw, meta, tmp_path, "l").read_text()


def test_the_soak_page_is_stamped(tmp_path, monkeypatch):
    monkeypatch.setattr(soak, "stamp", lambda: MEASURED)
    args = SimpleNamespace(
        warmup=0.2, minutes=1.0, sessions=2, argv=["soak"], sample_s=5.0, max_growth_mib=50.0
    )
    tally = soak.Tally(kinds=collections.Counter({"split": 1}), tokens=8)
    rows = [(0.0, {role: 2**20 for role in soak.ROLES}), (60.0, {"gateway": 2**21})]
    out = tmp_path / "soak.md"
    soak.write_report(out, args, tally, rows, {"gateway": 1.0}, 60.0, False)
    assert LINE in out.read_text()
