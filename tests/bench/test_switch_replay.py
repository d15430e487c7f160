"""bench/switch_replay.py: recorded lock-step rounds, replayed through auto's switch rule."""

import json

from bench.switch_replay import leads, rounds, score


def record(mode: str, rtt_ms: float, verify_ms: float, wall_s: float = 10.0) -> dict:
    """Five rounds of 8 drafts keeping 3, 8, 3, 8, 3 (30 tokens), 0.1 s apart."""
    kept = [3, 8, 3, 8, 3]
    times = [t for i, a in enumerate(kept) for t in [0.1 * (i + 1)] * (a + 1)]
    cycle = verify_ms + rtt_ms + 50
    return {
        "mode": mode,
        "class": "code",
        "rtt_ms": rtt_ms,
        "link": "",
        "temperature": 0.0,
        "k": 8,
        "new_tokens": len(times),
        "wall_s": wall_s,
        "token_times_s": times,
        "k_chosen": [8] * 5,
        "round_ms": [cycle] * 5,
        "verify_ms": [verify_ms] * 5,
        "server_ms": [verify_ms + 5] * 5,
    }


def test_rounds_are_read_back_from_the_token_times():
    played = rounds(record("lock-step-adaptive", 100, 300))
    assert [(k, a) for k, a, *_ in played] == [(8, 3), (8, 8), (8, 3), (8, 8), (8, 3)]
    assert played[1][2] == 100.0  # cycle: from the previous verdict's tokens, 0.1 s apart


def test_a_slow_link_leads_and_a_fast_one_does_not():
    assert leads(record("lock-step-adaptive", 2000, 20))
    assert not leads(record("lock-step-adaptive", 0, 300))


def test_score_sets_the_rule_against_measured_speed(tmp_path):
    raw = tmp_path / "raw.jsonl"
    recs = [
        record("lock-step-adaptive", 2000, 20, wall_s=10.0),
        record("cloud-led", 2000, 20, wall_s=8.0),
        record("cloud-only", 2000, 20),  # same cell, another mode: not in the score
    ]
    raw.write_text("".join(json.dumps(r) + "\n" for r in recs))
    [(cell, ratio, share)] = score([raw])
    assert cell == ("code", 2000, "", 0.0) and ratio == 10.0 / 8.0 and share == 1.0
