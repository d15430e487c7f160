"""`python -m bench.draft_prefill`: the draft's prefill tokens/s, peak RSS growth and step time.

One process, one draft export: a ``--tokens``-long prompt (real text: this repository's
README.md, tokenized by the draft's tokenizer) is prefilled once by ``edge.onnx_drafter``'s
``OnnxDrafter.forward``, then the median single-token step is timed at a short context, right
after the long prompt, and in a new short sequence after it (the KV buffers the long prompt
grew, shrunk again). Prefill rates are given in wall time and in this process's CPU time (one
thread: on a core shared with other work the CPU figure is the closer to an idle core's). Pin
it to one core for figures (``taskset -c 0``) and keep ``--threads 1``.

``--profile`` turns on ONNX Runtime's profiler for the prefill and prints the time per operator
type (the profile's node events, summed), the largest first.

``--target`` then prefills the same prompt into the default pair's target as ``specsplit-cloud
serve`` loads it (``cloud.engine.target.TargetModel``, weights ``auto``, ``--threads`` threads,
its prefill passes of ``PREFILL_CHUNK`` rows) in this process, on the same core, after the
draft's figures (so its memory counts in none of them), and prints its prefill rate next to the
draft's: the draft's prefill against the target's it runs beside.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from bench.rss import rss_bytes

README = Path(__file__).resolve().parent.parent / "README.md"


def prompt_ids(draft_dir: Path, n: int) -> list[int]:
    """``n`` token ids of real text (README.md, repeated as needed)."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(draft_dir / "tokenizer.json")).encode(README.read_text()).ids
    return (ids * (n // len(ids) + 1))[:n]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def op_times(profile: Path) -> dict[str, float]:
    """Milliseconds per operator type in an ONNX Runtime profile (its node events)."""
    totals: dict[str, float] = defaultdict(float)
    for event in json.loads(profile.read_text()):
        args = event.get("args", {})
        if (
            event.get("cat") == "Node"
            and "op_name" in args
            and event["name"].endswith("_kernel_time")
        ):
            totals[args["op_name"]] += event["dur"] / 1e3
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def step_ms(drafter, steps: int) -> tuple[float, float]:
    """Median (CPU ms, wall ms) of a single-token step after what the drafter holds (cache left
    as it was)."""
    base = len(drafter.cached)
    token = int(np.argmax(drafter.forward([drafter.cached[-1]])[-1]))
    cpu, wall = [], []
    for _ in range(steps):
        c0, w0 = time.process_time(), time.perf_counter()
        token = int(np.argmax(drafter.forward([token])[-1]))
        cpu.append((time.process_time() - c0) * 1e3)
        wall.append((time.perf_counter() - w0) * 1e3)
    drafter.truncate(base)
    return float(np.median(cpu)), float(np.median(wall))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.draft_prefill", description=__doc__)
    p.add_argument("--draft", type=Path, default=None, help="an export directory (default: int4)")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--target", action="store_true", help="also time the target's prefill")
    args = p.parse_args(argv)

    from specsplit.edge.export.ensure import ensure_draft_onnx
    from specsplit.edge.onnx_drafter import OnnxDrafter

    draft_dir = args.draft or ensure_draft_onnx()
    ids = prompt_ids(draft_dir, args.tokens)
    drafter = OnnxDrafter(draft_dir, threads=args.threads, profile=args.profile)
    drafter.forward(ids[:16])  # also warms the prefill path (first-run allocations)
    short = step_ms(drafter, args.steps)
    drafter.reset()
    rss0 = peak_rss_mb()
    t0, c0 = time.perf_counter(), time.process_time()
    drafter.forward(ids)
    prefill_s, prefill_cpu = time.perf_counter() - t0, time.process_time() - c0
    growth = peak_rss_mb() - rss0
    profile = drafter.end_profiling() if args.profile else None
    long = step_ms(drafter, args.steps)
    held = rss_bytes(os.getpid()) / 2**20  # 0 where /proc is not there
    drafter.reset()
    drafter.forward(ids[:16])  # a new short sequence, as a client's next prompt
    again = step_ms(drafter, args.steps)
    after = rss_bytes(os.getpid()) / 2**20
    print(f"draft: {draft_dir.name} ({drafter.precision}), {args.threads} thread(s)")
    print(
        f"prefill {args.tokens} tokens: {prefill_s:.2f} s = {args.tokens / prefill_s:.1f} tok/s "
        f"(CPU time {prefill_cpu:.2f} s = {args.tokens / prefill_cpu:.1f} tok/s), "
        f"peak RSS +{growth:.0f} MB"
    )
    print(
        f"step (CPU / wall ms): {short[0]:.1f} / {short[1]:.1f} after 16 positions, "
        f"{long[0]:.1f} / {long[1]:.1f} after {args.tokens}, "
        f"{again[0]:.1f} / {again[1]:.1f} after 16 again (a new sequence)"
    )
    if held and after:
        print(f"RSS {held:.0f} MB holding the long prompt, {after:.0f} MB in the new sequence")
    if profile:
        times = op_times(Path(profile))
        total = sum(times.values())
        for op, ms in list(times.items())[:12]:
            print(f"  {op:<28} {ms:9.0f} ms  {100 * ms / total:5.1f}%")
        print(f"  (profile: {profile}; the prefill and the steps before it)")
    if args.target:
        del drafter
        wall, cpu = target_prefill_s(ids, args.threads)
        print(
            f"target prefill {args.tokens} tokens: {wall:.2f} s = {args.tokens / wall:.1f} tok/s "
            f"(CPU time {cpu:.2f} s = {args.tokens / cpu:.1f} tok/s); the draft's is "
            f"{wall / prefill_s:.2f}x it (CPU time {cpu / prefill_cpu:.2f}x)"
        )
    return 0


def target_prefill_s(
    ids: list[int], threads: int, model: str | Path | None = None
) -> tuple[float, float]:
    """(wall s, CPU s) of the target's prefill of ``ids`` (``model``: the default pair's): its
    session opened with them (``TargetModel.start`` prefills all but the last) and its first
    step (the last one)."""
    from specsplit.cloud.engine.target import SessionParams, TargetModel
    from specsplit.shared.acceptance import VerificationRule
    from specsplit.shared.sampling import SamplingConfig
    from specsplit.shared.weights.sources import TARGET_DEFAULT, resolve_model

    model_dir = resolve_model(model or TARGET_DEFAULT.name)
    target = TargetModel(model_dir, device="cpu", threads=threads)
    params = SessionParams(SamplingConfig(), VerificationRule.GREEDY)
    target.start(0, ids[:16], params)  # warms the passes' first-run allocations
    target.verify(0, 16, [ids[15]])
    target.end(0)
    t0, c0 = time.perf_counter(), time.process_time()
    target.start(1, ids, params)
    target.verify(1, len(ids), [ids[-1]])
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    target.end(1)
    return wall, cpu


if __name__ == "__main__":
    sys.exit(main())
