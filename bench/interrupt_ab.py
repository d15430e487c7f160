"""`python -m bench.interrupt_ab`: the draft pass cut short at a correction
(``OnnxDrafter.interrupt``, docs/design.md#cloud-led) against the same split with every pass run
out, on one running server.

Each prompt (bench/prompts.jsonl ids, chat template) runs ``--repeats`` times in each mode, a
fresh client each time with the drafter's cache emptied (cold, as a new CLI process), the two arms
taking turns in alternating order (cut, then not; not, then cut), so that a busy spell of a shared
machine falls on both. Reported per mode, class and arm: tok/s, target passes per token, the
passes after a correction and the draftless ones among them, the workers stopped (their passes
cut short, in the arm that cuts). Start the server first, pinned to a core of its own, and pin
this process to another; let the server answer one request before (its first is slower):

    taskset -c 1 .venv/bin/specsplit-cloud serve --threads 1 --insecure --port 50061 &
    taskset -c 0 .venv/bin/python -m bench.interrupt_ab --server 127.0.0.1:50061
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.draft_ab import DEFAULT_PROMPTS, differing, groups, prompt_rows, take_turns

ARMS = ("cut", "run out")


async def generate(address: str, drafter, ids: list[int], mode: str, max_new_tokens: int) -> dict:
    from specsplit.edge.client import GenerationConfig, SplitClient

    drafter.reset()
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, session_mode=mode)
    async with SplitClient(address, drafter) as client:
        gen = client.generate(ids, cfg)
        await gen.collect()
    s = gen.stats
    return {
        "new_tokens": s.new_tokens,
        "wall_s": s.wall_s,
        "passes": s.target_forward_passes,
        "after_correction": s.passes_after_rejection,
        "draftless": s.draftless_after_rejection,
        "cut": s.interrupted,
        "token_ids": list(gen.token_ids),
    }


class RunOut:
    """The drafter with ``interrupt`` doing nothing: every pass runs to its end (the other arm)."""

    def __init__(self, drafter) -> None:
        self.drafter = drafter

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def interrupt(self) -> None:
        pass


def summarise(records: list[dict]) -> list[tuple]:
    """(mode, class, arm, n, tok/s, passes/token, after a correction, draftless, workers stopped)
    per group, sums over its generations."""
    return [
        (
            *key,
            len(rr),
            tps,
            sum(r["passes"] for r in rr) / tokens,
            sum(r["after_correction"] for r in rr),
            sum(r["draftless"] for r in rr),
            sum(r["cut"] for r in rr),
        )
        for key, rr, tokens, tps in groups(records)
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.interrupt_ab", description=__doc__)
    p.add_argument("--server", required=True, help="host:port of a running specsplit-cloud")
    p.add_argument("--draft", type=Path, default=None, help="an export directory (default: int4)")
    p.add_argument("--mode", action="append", help="session modes [cloud-led, auto]")
    p.add_argument("--prompt", action="append", help=f"prompt ids {list(DEFAULT_PROMPTS)}")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=None, help="write each generation here (jsonl)")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.max_new_tokens < 1:
        p.error("--repeats and --max-new-tokens must be >= 1")
    rows, wanted = prompt_rows(p, args.prompt)

    from specsplit.edge.export.ensure import ensure_draft_onnx
    from specsplit.edge.onnx_drafter import OnnxDrafter
    from specsplit.edge.text import TextCodec

    draft = args.draft or ensure_draft_onnx()  # the default draft, as the edge ships it
    codec = TextCodec(draft)
    cut = OnnxDrafter(draft, threads=1)
    arms = dict(zip(ARMS, (cut, RunOut(cut)), strict=True))

    async def ask(drafter, ids, mode):
        return await generate(args.server, drafter, ids, mode, args.max_new_tokens)

    modes = args.mode or ["cloud-led", "auto"]
    out = args.out.open("w") if args.out else None
    try:
        records = take_turns(ask, arms, codec, rows, wanted, modes, args.repeats, out)
    finally:
        if out is not None:
            out.close()
    print(
        "| mode | class | arm | n | tok/s | passes/token | passes after a correction "
        "| draftless | workers stopped |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for mode, cls, arm, n, tps, ppt, after, draftless, cuts in summarise(records):
        print(
            f"| {mode} | {cls} | {arm} | {n} | {tps:.2f} | {ppt:.3f} | {after} | {draftless} "
            f"| {cuts} |"
        )
    bad, pairs = differing(records)
    print(f"\ngreedy output of the two arms different in {bad} of {pairs} pairs")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
