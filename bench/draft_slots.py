"""`python -m bench.draft_slots`: what `specsplit-edge serve`'s drafters cost at once, as sessions
of their own or sharing one (``OnnxDrafter.another``, the endpoint's way).

For each count of drafters (``--slots``) and each way, one process of its own loads them, gives
each a ``--prompt``-token prefix, then every drafter steps ``--steps`` single tokens in a thread of
its own, all at once (the endpoint's concurrent requests drafting). It prints the process's RSS
after the prefixes, each drafter's ms per step, and the steps per second of all together (the
best of ``--repeats``). ``--threads``: each session's intra-op threads (default: the drafter's,
as the endpoint runs it).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def measure(draft_dir: Path, slots: int, shared: bool, threads, prompt: int, steps: int, repeats):
    """One configuration, in this process: (RSS MB, [ms per step per drafter], steps/s)."""
    from specsplit.edge.onnx_drafter import OnnxDrafter

    first = OnnxDrafter(draft_dir, threads=threads)
    drafters = [first] + [
        first.another() if shared else OnnxDrafter(draft_dir, threads=threads)
        for _ in range(slots - 1)
    ]
    prefix = [i % first.token_count for i in range(1, prompt + 1)]
    for d in drafters:
        d.forward(prefix)
    rss = rss_mb()

    def run(i: int, per: list[float]) -> None:
        d = drafters[i]
        d.truncate(prompt)
        t0 = time.perf_counter()
        for j in range(steps):
            d.forward([(j * 7 + i) % d.token_count])
        per[i] = (time.perf_counter() - t0) * 1e3 / steps

    best = None
    for _ in range(repeats):
        per = [0.0] * slots
        threads_ = [threading.Thread(target=run, args=(i, per)) for i in range(slots)]
        t0 = time.perf_counter()
        for t in threads_:
            t.start()
        for t in threads_:
            t.join()
        rate = slots * steps / (time.perf_counter() - t0)
        if best is None or rate > best[2]:
            best = (rss, per, rate)
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.draft_slots", description=__doc__)
    p.add_argument("--draft", type=Path, default=None, help="an export directory (default: int4)")
    p.add_argument("--slots", type=int, action="append", help="drafters at once [1, 2, 4]")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--prompt", type=int, default=300)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--one", help=argparse.SUPPRESS)  # "SLOTS,shared|separate": this process
    args = p.parse_args(argv)
    if min(args.slots or [1]) < 1 or args.prompt < 1 or args.steps < 1 or args.repeats < 1:
        p.error("--slots, --prompt, --steps and --repeats must be >= 1")

    from specsplit.edge.export.ensure import ensure_draft_onnx

    draft_dir = args.draft or ensure_draft_onnx()
    if args.one:
        n, way = args.one.split(",")
        out = measure(
            draft_dir, int(n), way == "shared", args.threads, args.prompt, args.steps, args.repeats
        )
        print(json.dumps(out))
        return 0
    print(f"draft: {draft_dir.name}; prompt {args.prompt} tokens, {args.steps} steps each")
    print(f"{'drafters':>8} {'sessions':>9} {'RSS MB':>7} {'steps/s':>8}  ms/step each")
    for n in args.slots or [1, 2, 4]:
        for way in ("separate", "shared") if n > 1 else ("shared",):
            cmd = [sys.executable, "-m", "bench.draft_slots", "--one", f"{n},{way}"]
            cmd += ["--draft", str(draft_dir), "--prompt", str(args.prompt)]
            cmd += ["--steps", str(args.steps), "--repeats", str(args.repeats)]
            if args.threads is not None:
                cmd += ["--threads", str(args.threads)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            rss, per, rate = json.loads(done.stdout.strip().splitlines()[-1])
            sessions = "1" if way == "shared" else str(n)
            each = " ".join(f"{x:.1f}" for x in per)
            print(f"{n:>8} {sessions:>9} {rss:>7.0f} {rate:>8.1f}  {each}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
