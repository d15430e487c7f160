"""bench.peers_interleaved: the turns it takes and the table it prints (the run itself needs the
real servers: `make bench-peers-interleaved`)."""

from __future__ import annotations

import pytest

from bench.peers_interleaved import SETUPS, summarize, table, turns


def test_each_repeat_rotates_which_setup_goes_first():
    assert [turns(r) for r in range(4)] == [
        ("llama.cpp", "cloud-only", "split"),
        ("cloud-only", "split", "llama.cpp"),
        ("split", "llama.cpp", "cloud-only"),
        ("llama.cpp", "cloud-only", "split"),
    ]
    assert all(sorted(turns(r)) == sorted(SETUPS) for r in range(6))


def rec(setup: str, new: int, wall: float) -> dict:
    return {"setup": setup, "new_tokens": new, "wall_s": wall}


def test_rates_are_tokens_over_summed_walls_and_ratios_are_to_llama_cpp():
    records = [
        rec("llama.cpp", 64, 4.0),
        rec("llama.cpp", 64, 4.0),  # 16 tok/s
        rec("cloud-only", 64, 3.0),
        rec("cloud-only", 32, 3.0),  # 16 tok/s
        rec("split", 64, 2.0),
        rec("split", 64, 2.0),  # 32 tok/s
    ]
    by = {s["setup"]: s for s in summarize(records)}
    assert by["llama.cpp"]["tok_s"] == pytest.approx(16.0)
    assert by["cloud-only"]["vs_llama"] == pytest.approx(1.0)
    assert by["split"]["vs_llama"] == pytest.approx(2.0)
    assert by["split"]["generations"] == 2
    text = table(summarize(records))
    assert "| 2 | **32.00** | 2.00× |" in text
    assert len(text.splitlines()) == 2 + len(SETUPS)


def test_a_setup_that_ran_nothing_shows_dashes():
    (llama, cloud, split) = summarize([rec("cloud-only", 64, 4.0)])
    assert llama["tok_s"] is None and cloud["vs_llama"] is None
    assert "| 0 | – | – |" in table([llama, cloud, split])
