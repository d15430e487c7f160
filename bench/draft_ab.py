"""`python -m bench.draft_ab`: two draft exports side by side on one running server, as the split
runs them: tokens/s, target passes per token, the edge's CPU time and draft forwards per token.

Each prompt (bench/prompts.jsonl ids, chat template) runs ``--repeats`` times in each mode, a
fresh client each time (cold: no remembered link), the drafts taking turns in alternating order
(A B, then B A), so a busy spell on a shared machine falls on both alike; the drafter's cache is
emptied before each generation, as a new CLI process has it. Start the server first, pinned to a
core of its own, and pin this process to another:

    taskset -c 1 .venv/bin/specsplit-cloud serve --threads 1 --insecure --port 50061 &
    taskset -c 0 .venv/bin/python -m bench.draft_ab --server 127.0.0.1:50061 DRAFT_A DRAFT_B

Edge CPU is this process's CPU time over the generation (``time.process_time``: the client's
own work included, alike for both drafts).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

PROMPTS = Path(__file__).resolve().parent / "prompts.jsonl"
DEFAULT_PROMPTS = ("code-00", "code-01", "code-02", "code-03")
DEFAULT_PROMPTS += ("prose-00", "prose-01", "prose-02", "prose-03")


class _Counted:
    """A drafter whose ``forward`` calls are counted (the draft's passes, drafted or not)."""

    def __init__(self, drafter) -> None:
        self.drafter, self.forwards = drafter, 0

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def forward(self, tokens, all_logits: bool = False):
        self.forwards += 1
        return self.drafter.forward(tokens, all_logits)


async def generate(address: str, drafter, ids: list[int], mode: str, max_new_tokens: int) -> dict:
    """One cold generation: its stats, CPU seconds and the draft's forwards."""
    from specsplit.edge.client import GenerationConfig, SplitClient

    drafter.reset()
    counted = _Counted(drafter)
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, session_mode=mode)
    c0 = time.process_time()
    async with SplitClient(address, counted) as client:
        gen = client.generate(ids, cfg)
        await gen.collect()
    s = gen.stats
    return {
        "new_tokens": s.new_tokens,
        "wall_s": s.wall_s,
        "passes": s.target_forward_passes,
        "cpu_s": time.process_time() - c0,
        "forwards": counted.forwards,
        "token_ids": list(gen.token_ids),
    }


def groups(records: list[dict]) -> list[tuple[tuple, list[dict], int, float]]:
    """((mode, class, arm), its generations, their new tokens, their tok/s) per group, sorted:
    sums over a group's generations, not means of their ratios."""
    grouped: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        grouped[(r["mode"], r["class"], r["arm"])].append(r)
    out = []
    for key, rr in sorted(grouped.items()):
        tokens = sum(r["new_tokens"] for r in rr)
        out.append((key, rr, tokens, tokens / sum(r["wall_s"] for r in rr)))
    return out


def summarise(records: list[dict]) -> list[tuple]:
    """(mode, class, draft, n, tok/s, passes/token, edge CPU ms/token, forwards/token) per
    group, over all its generations (sums, not means of ratios)."""
    return [
        (
            *key,
            len(rr),
            tps,
            sum(r["passes"] for r in rr) / tokens,
            sum(r["cpu_s"] for r in rr) * 1e3 / tokens,
            sum(r["forwards"] for r in rr) / tokens,
        )
        for key, rr, tokens, tps in groups(records)
    ]


def differing(records: list[dict]) -> tuple[int, int]:
    """(generations whose greedy tokens differ from the other arm's, pairs compared): both
    arms' splits must give the target's own output, token for token."""
    pairs: dict[tuple, list[list[int]]] = defaultdict(list)
    for r in records:
        pairs[(r["mode"], r["prompt"], r["repeat"])].append(r["token_ids"])
    compared = [ids for ids in pairs.values() if len(ids) == 2]
    return sum(a != b for a, b in compared), len(compared)


def prompt_rows(p: argparse.ArgumentParser, wanted: list[str] | None) -> tuple[dict, list[str]]:
    """bench/prompts.jsonl by id, and the ids asked for (DEFAULT_PROMPTS when none); an unknown
    id ends the program through ``p`` before any work."""
    rows = {json.loads(line)["id"]: json.loads(line) for line in PROMPTS.read_text().splitlines()}
    wanted = wanted or list(DEFAULT_PROMPTS)
    unknown = [pid for pid in wanted if pid not in rows]
    if unknown:
        p.error(f"unknown prompt ids {unknown} (bench/prompts.jsonl)")
    return rows, wanted


def take_turns(ask, arms: dict, codec, rows: dict, wanted, modes, repeats: int, out) -> list[dict]:
    """Every prompt x mode x repeat once per arm, the arms taking turns in alternating order
    (A B, then B A) so that a busy spell falls on both: ``ask(drafter, ids, mode)`` gives a
    generation's record, to which this adds arm, prompt, mode, repeat and class, writes it to
    ``out`` (jsonl, when not None) and reports its tok/s on stderr."""
    names, records = list(arms), []
    for rep in range(repeats):
        for pid in wanted:
            ids = codec.chat_prompt(rows[pid]["prompt"])
            for mode in modes:
                for name in names if rep % 2 == 0 else names[::-1]:
                    one = asyncio.run(ask(arms[name], ids, mode))
                    one.update(arm=name, prompt=pid, mode=mode, repeat=rep)
                    one["class"] = rows[pid]["class"]
                    records.append(one)
                    if out is not None:
                        out.write(json.dumps(one) + "\n")
                    tps = one["new_tokens"] / one["wall_s"]
                    print(f"{mode} {pid} #{rep} {name}: {tps:.2f} tok/s", file=sys.stderr)
    return records


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.draft_ab", description=__doc__)
    p.add_argument("drafts", nargs=2, type=Path, help="two export directories")
    p.add_argument("--server", required=True, help="host:port of a running specsplit-cloud")
    p.add_argument("--mode", action="append", help="session modes [auto, cloud-led]")
    p.add_argument("--prompt", action="append", help=f"prompt ids {list(DEFAULT_PROMPTS)}")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=None, help="write each generation here (jsonl)")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.max_new_tokens < 1:
        p.error("--repeats and --max-new-tokens must be >= 1")
    rows, wanted = prompt_rows(p, args.prompt)

    from specsplit.edge.onnx_drafter import OnnxDrafter
    from specsplit.edge.text import TextCodec

    codec = TextCodec(args.drafts[0])
    names = [d.name for d in args.drafts]
    if names[0] == names[1]:
        names = [f"A {names[0]}", f"B {names[1]}"]
    arms = {name: OnnxDrafter(d, threads=1) for name, d in zip(names, args.drafts, strict=True)}

    async def ask(drafter, ids, mode):
        return await generate(args.server, drafter, ids, mode, args.max_new_tokens)

    modes = args.mode or ["auto", "cloud-led"]
    out = args.out.open("w") if args.out else None
    try:
        records = take_turns(ask, arms, codec, rows, wanted, modes, args.repeats, out)
    finally:
        if out is not None:
            out.close()
    head = (
        "| mode | class | draft | n | tok/s | passes/token | edge CPU ms/token | forwards/token |"
    )
    print(head)
    print("|---|---|---|---|---|---|---|---|")
    for mode, cls, draft, n, tps, ppt, cpu, fwd in summarise(records):
        print(f"| {mode} | {cls} | {draft} | {n} | {tps:.2f} | {ppt:.3f} | {cpu:.1f} | {fwd:.2f} |")
    bad, pairs = differing(records)
    print(f"\ngreedy output of the two drafts' splits different in {bad} of {pairs} pairs")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
