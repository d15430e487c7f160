"""`python -m bench.draft_agreement`: draft exports side by side: step time, teacher-forced
agreement with the served target on code and prose, bytes.

The reference is the target as ``specsplit-cloud serve`` runs it by default
(``cloud.engine.target.TargetModel``, weights ``auto``): its greedy continuation of
``--prompts`` chat prompts per class of bench/prompts.jsonl, ``--tokens`` tokens each, computed
once and kept in ``--reference`` (a JSON file; delete it to recompute). A draft's agreement is
the fraction of those positions where its top token, given the target's text so far
(teacher-forced, one pass per prompt), is the target's token: the greedy acceptance rate of a
one-token block.

Step time: the median of ``--rounds`` x ``--steps`` single-token steps after 300 tokens of the
target's continuations (text as generation meets it), the drafters taking turns, in CPU time
of this process (``time.process_time``: one thread, so a core shared with other work inflates
it less than wall time) and in wall time. Pin it to one core (``taskset -c 0``). A draft whose
LM head is split by frequency (``export --head-vocab``) computes the other ids only while the
last tokens hold one (edge.onnx_drafter.RARE_WINDOW): its steps are timed again after an id
outside its frequent rows ("rare id near"), the cost where text leaves them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

PROMPTS = Path(__file__).resolve().parent / "prompts.jsonl"
TARGET = "qwen2.5-coder-1.5b-instruct"


def chat_prompts(codec, per_class: int) -> list[tuple[str, list[int]]]:
    """(class, chat prompt ids) for the first ``per_class`` prompts of each class."""
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    out = []
    for cls in ("code", "prose"):
        for row in [r for r in rows if r["class"] == cls][:per_class]:
            out.append((cls, list(codec.chat_prompt(row["prompt"]))))
    return out


def target_continuations(prompts, tokens: int) -> list[list[int]]:
    """The served target's greedy continuation of each prompt (``tokens`` ids)."""
    from specsplit.cloud.engine.target import SessionParams, TargetModel
    from specsplit.shared.acceptance import VerificationRule
    from specsplit.shared.sampling import SamplingConfig
    from specsplit.shared.weights.sources import resolve_model

    target = TargetModel(resolve_model(TARGET), device="cpu", threads=1, calibrate=False)
    params = SessionParams(SamplingConfig(), VerificationRule.GREEDY)
    out = []
    for sid, (_, prompt) in enumerate(prompts):
        target.start(sid, prompt, params)
        seq = list(prompt)
        for _ in range(tokens):
            seq.append(target.verify(sid, len(seq), [seq[-1]]).token)
        target.end(sid)
        out.append(seq[len(prompt) :])
    return out


def agreement(drafter, prompts, continuations) -> dict[str, float]:
    """Per class: the fraction of positions where the draft's top token is the target's."""
    hits: dict[str, list[bool]] = {}
    for (cls, prompt), cont in zip(prompts, continuations, strict=True):
        drafter.reset()
        if len(prompt) > 1:
            drafter.forward(prompt[:-1])
        logits = drafter.forward([prompt[-1], *cont[:-1]], all_logits=True)  # [len(cont), V]
        hits.setdefault(cls, []).extend((logits.argmax(axis=-1) == np.asarray(cont)).tolist())
    drafter.reset()
    return {cls: float(np.mean(h)) for cls, h in hits.items()}


def step_times(drafters, steps: int, rounds: int, context: list[int]) -> list[tuple[float, float]]:
    """Median (CPU ms, wall ms) of each drafter's single-token steps after ``context``; the
    drafters take turns, ``steps`` steps each a round, so a busy spell on a shared core falls on
    all of them alike."""
    cpu: list[list[float]] = [[] for _ in drafters]
    wall: list[list[float]] = [[] for _ in drafters]
    tokens = []
    for drafter in drafters:
        drafter.reset()
        tokens.append(int(np.argmax(drafter.forward(context)[-1])))
    for _ in range(rounds):
        for i, drafter in enumerate(drafters):
            drafter.truncate(len(context))
            token = tokens[i]
            for _ in range(steps):
                c0, w0 = time.process_time(), time.perf_counter()
                token = int(np.argmax(drafter.forward([token])[-1]))
                cpu[i].append((time.process_time() - c0) * 1e3)
                wall[i].append((time.perf_counter() - w0) * 1e3)
    for drafter in drafters:
        drafter.reset()
    return [(float(np.median(c)), float(np.median(w))) for c, w in zip(cpu, wall, strict=True)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.draft_agreement", description=__doc__)
    p.add_argument("drafts", nargs="+", type=Path, help="export directories")
    p.add_argument("--prompts", type=int, default=3, help="per class (code, prose)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=8, help="steps a drafter takes per round")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--reference", type=Path, default=Path("draft_agreement_reference.json"))
    args = p.parse_args(argv)

    from specsplit.edge.onnx_drafter import OnnxDrafter
    from specsplit.edge.text import TextCodec

    prompts = chat_prompts(TextCodec(args.drafts[0]), args.prompts)
    key = json.loads(json.dumps({"prompts": prompts, "tokens": args.tokens, "target": TARGET}))
    saved = json.loads(args.reference.read_text()) if args.reference.exists() else {}
    if saved.get("key") != key:
        saved = {"key": key, "continuations": target_continuations(prompts, args.tokens)}
        args.reference.write_text(json.dumps(saved))
    continuations = saved["continuations"]
    context = ([t for cont in continuations for t in cont] * 8)[:300]
    drafters = [OnnxDrafter(draft, threads=1) for draft in args.drafts]
    agree = [agreement(drafter, prompts, continuations) for drafter in drafters]
    times = step_times(drafters, args.steps, args.rounds, context)
    # a split head's steps again, with an id outside its frequent rows just before them
    rare = {i: r for i, draft in enumerate(args.drafts) if (r := rare_id(draft)) is not None}
    rare_times = {
        i: step_times([drafters[i]], args.steps, args.rounds, [*context, r])[0]
        for i, r in rare.items()
    }
    print(
        "| draft | ms/token (CPU) | ms/token (wall) | rare id near (CPU) | agreement, code "
        "| agreement, prose | bytes |"
    )
    print("|---|---|---|---|---|---|---|")
    for i, (draft, a, (cpu, wall)) in enumerate(zip(args.drafts, agree, times, strict=True)):
        size = sum(f.stat().st_size for f in draft.iterdir() if f.name.startswith("model.onnx"))
        near = f"{rare_times[i][0]:.1f}" if i in rare_times else "-"
        print(
            f"| {draft.name} | {cpu:.1f} | {wall:.1f} | {near} | {a['code']:.3f} | "
            f"{a['prose']:.3f} | {size / 1e6:.0f} MB |"
        )
    return 0


def rare_id(draft: Path) -> int | None:
    """An id outside a split LM head's frequent rows (None: the head is not split)."""
    path = draft / "lm_head_ids.npy"
    if not path.exists():
        return None
    kept = np.load(path)
    return int(np.setdiff1d(np.arange(int(kept.max()) + 2), kept)[0])


if __name__ == "__main__":
    sys.exit(main())
