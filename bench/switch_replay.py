"""Replays recorded lock-step adaptive rounds through auto's switch rule (edge/mode_switch.py).

``make bench`` records, per generation, each round's block size, tokens, cycle and pass times.
Fed to ``LeadChoice`` in order, the rounds of a lock-step adaptive run say in which round auto,
had it been that run, would have handed over to cloud-led. Set against the same run's measured
cloud-led and lock-step adaptive tok/s per cell, that scores the rule without a new bench run:
a cell's regret is the share of its runs that chose the slower mode times how much slower it
measured. Cloud-led from Start is not auto handing over mid-stream (a switch fires on the runs
whose acceptance so far was poor), so a low regret here is a reason to bench a rule, not proof
that it is faster. Usage: ``python -m bench.switch_replay RAW.jsonl ...``.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections import defaultdict
from pathlib import Path

from specsplit.edge.mode_switch import LeadChoice


def rounds(record: dict) -> list[tuple[int, int, float, float, float]]:
    """(k, accepted, cycle_ms, verify_ms, server_ms) per round of a lock-step record."""
    verdicts = [(t, len(list(g))) for t, g in itertools.groupby(record["token_times_s"])]
    times, counts = [t for t, _ in verdicts], [n for _, n in verdicts]
    out = []
    for i, k in enumerate(record["k_chosen"][: len(times)]):
        cycle = record["round_ms"][i] if i == 0 else (times[i] - times[i - 1]) * 1e3
        accepted = min(counts[i] - 1, k)  # a verdict: the accepted drafts and one token
        out.append((k, accepted, cycle, record["verify_ms"][i], record["server_ms"][i]))
    return out


def leads(record: dict) -> bool:
    """Would auto have handed over in this run (before its last round)?"""
    choice = LeadChoice(record["k"], record["temperature"] == 0)
    played = rounds(record)
    remaining = record["new_tokens"]
    for (k, accepted, cycle, verify, server), (k_next, *_) in itertools.pairwise(played):
        choice.observe(k, accepted, cycle, verify, server)
        remaining -= accepted + 1
        # as edge/lockstep.py: only with blocks left after the one that would lead
        if remaining > k_next + 1 and choice.should_lead(k_next):
            return True
    return False


def cell(r: dict) -> tuple:
    return (r["class"], r["rtt_ms"], r["link"], r["temperature"])


def score(paths: list[Path]) -> list[tuple[tuple, float, float]]:
    """Per cell: measured cloud-led / lock-step adaptive tok/s, share of runs that lead."""
    speed: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    lead: dict[tuple, list[bool]] = defaultdict(list)
    for path in paths:
        for r in map(json.loads, path.read_text().splitlines()):
            col = {"cloud-led": 0, "lock-step-adaptive": 2}.get(r["mode"])
            if col is not None:
                speed[cell(r)][col] += r["new_tokens"]
                speed[cell(r)][col + 1] += r["wall_s"]
            if r["mode"] == "lock-step-adaptive" and r["k_chosen"]:
                lead[cell(r)].append(leads(r))
    out = []
    for key in sorted(lead):
        cl_tok, cl_s, ls_tok, ls_s = speed[key]
        if cl_s and ls_s:
            out.append((key, (cl_tok / cl_s) / (ls_tok / ls_s), sum(lead[key]) / len(lead[key])))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.switch_replay", description=__doc__)
    p.add_argument("raw", nargs="+", type=Path, help="benchmarks-raw.jsonl files of make bench")
    args = p.parse_args(argv)
    rows = score(args.raw)
    print("| class | RTT ms | link | T | cloud-led ÷ lock-step adaptive | runs that lead |")
    print("|---|---|---|---|---|---|")
    regret = 0.0
    for (cls, rtt, link, t), ratio, share in rows:
        print(f"| {cls} | {rtt:g} | {link or '-'} | {t:g} | {ratio:.2f} | {share:.2f} |")
        regret += share * (1 - ratio) if ratio < 1 else (1 - share) * (ratio - 1)
    print(f"\nregret (sum over cells of the wrong mode's share times its loss): {regret:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
