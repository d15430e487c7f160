"""`make soak`: many concurrent sessions for minutes against a real `specsplit-cloud serve`.

64 closed-loop edge workers (tiny models, each with its own ONNX drafter and connection) generate
back to back for ``--minutes``: split and cloud-only, greedy and sampled, and some cancelled at a
random moment. Every greedy output must equal the target's own greedy output; any other failure
is an error. The resident memory of every process of the serve tree (gateway, tritonserver, its
Python backend stub) is sampled every few seconds. Writes ``docs/soak.md`` with the curve (a
table and ``docs/soak.png``) and exits 1 on any error or when a process grew more than
``--max-growth-mib`` between the end of the warm-up and the end of the run.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from bench.rss import tree_rss
from bench.stamp import stamp, stamp_line
from specsplit.cloud.supervision.process import CloudProcess
from specsplit.edge.client import GenerationConfig, SplitClient
from specsplit.shared.sampling import SamplingConfig

HERE = Path(__file__).parent
console = Console(stderr=True)
ROLES = ("gateway", "tritonserver", "stub")
PROMPTS = 8
MAX_NEW = 48
CANCEL_RATE = 0.1


@dataclass
class Tally:
    kinds: collections.Counter = field(default_factory=collections.Counter)
    tokens: int = 0
    errors: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Kind:
    mode: str  # split | cloud-only
    temperature: float
    cancel: bool

    def __str__(self) -> str:
        t = "greedy" if self.temperature == 0 else f"T={self.temperature:g}"
        return f"{self.mode} {t}" + (" cancelled" if self.cancel else "")


def pick(rng: random.Random) -> Kind:
    return Kind(
        mode=rng.choice(("split", "split", "cloud-only")),
        temperature=rng.choice((0.0, 0.8)),
        cancel=rng.random() < CANCEL_RATE,
    )


async def generate_once(client, rng, prompts, references, kind: Kind, tally: Tally) -> None:
    i = rng.randrange(len(prompts))
    cfg = GenerationConfig(
        max_new_tokens=MAX_NEW, sampling=SamplingConfig(temperature=kind.temperature)
    )
    task = asyncio.ensure_future(client.generate(prompts[i], cfg, route=kind.mode).collect())
    if kind.cancel:
        await asyncio.wait([task], timeout=rng.uniform(0.0, 0.3))
        task.cancel()
    try:
        out = await task
    except asyncio.CancelledError:
        if not kind.cancel:
            raise
        tally.kinds[str(kind)] += 1
        return
    tally.kinds[str(kind)] += 1
    tally.tokens += len(out)
    if kind.temperature == 0 and out != references[i]:
        tally.errors.append(f"{kind}: prompt {i} gave {out}, the target {references[i]}")


async def worker(j, address, draft_onnx, prompts, references, deadline, tally) -> None:
    from specsplit.edge.onnx_drafter import OnnxDrafter

    rng = random.Random(j)
    async with SplitClient(address, OnnxDrafter(draft_onnx, threads=1)) as client:
        while time.monotonic() < deadline:
            kind = pick(rng)
            try:
                await generate_once(client, rng, prompts, references, kind, tally)
            except Exception as e:  # counted, never fatal: the soak reports them all
                tally.errors.append(f"{kind}: {type(e).__name__}: {e}")


class Sampler(threading.Thread):
    """RSS of the serve tree every ``period_s``: rows of (seconds since start, {role: bytes})."""

    def __init__(self, root_pid: int, period_s: float):
        super().__init__(daemon=True)
        self.root_pid, self.period_s = root_pid, period_s
        self.rows: list[tuple[float, dict[str, int]]] = []
        self.stop = threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        while True:
            self.rows.append((time.monotonic() - self.t0, tree_rss(self.root_pid)))
            if self.stop.wait(self.period_s):
                return


def growth(rows, warmup_s: float) -> dict[str, float]:
    """MiB per role: the median of the last three samples minus that of the three samples at
    the end of the warm-up (pools and caches fill first; a leak keeps growing after)."""
    after = [r for t, r in rows if t >= warmup_s] or [rows[-1][1]]
    first, last = after[:3], after[-3:]
    return {
        role: (
            statistics.median(r.get(role, 0) for r in last)
            - statistics.median(r.get(role, 0) for r in first)
        )
        / 2**20
        for role in ROLES
    }


def write_report(out: Path, args, tally: Tally, rows, grown, elapsed_s: float, failed) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    png = out.with_suffix(".png")
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for role in ROLES:
        ax.plot([t / 60 for t, _ in rows], [r.get(role, 0) / 2**20 for _, r in rows], label=role)
    ax.axvline(args.warmup * args.minutes, color="grey", linestyle=":", label="end of warm-up")
    ax.set_xlabel("minutes")
    ax.set_ylabel("RSS (MiB)")
    ax.set_title(f"{args.sessions} concurrent sessions, tiny models")
    ax.legend(loc="center right")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    done = sum(tally.kinds.values())
    lines = [
        "# Soak: concurrent sessions against a real `specsplit-cloud serve`",
        "",
        stamp_line(stamp()),
        "",
        f"`{' '.join(args.argv)}`: {args.sessions} closed-loop workers for "
        f"{elapsed_s / 60:.1f} min (tiny random models, {MAX_NEW} new tokens a generation, "
        f"{CANCEL_RATE:.0%} cancelled at a random moment; serve with --max-sessions "
        f"{args.sessions + 16}: a cancelled stream holds its place until the gateway sees the "
        f"cancel), RSS sampled every {args.sample_s:g} s.",
        "",
        f"**{'FAILED' if failed else 'PASSED'}**: {done} generations, {tally.tokens} tokens, "
        f"{len(tally.errors)} errors; RSS growth after the warm-up (first "
        f"{args.warmup:.0%}), limit {args.max_growth_mib:g} MiB: "
        + ", ".join(f"{role} {mib:+.1f} MiB" for role, mib in grown.items()),
        "",
        f"![RSS]({png.name})",
        "",
        "The stub's rise in the first minute is not sessions: the target's oneDNN-packed Linear "
        "layers keep state per distinct batch row count (measured with the tiny target: about "
        "2.4 MiB per new row count for the first 200, levelling off at oneDNN's primitive cache "
        "limit); with `SPECSPLIT_PACKED_LINEAR=0` the stub stays flat under the same load.",
        "",
        "| generations by kind | count |",
        "|---|---:|",
        *(f"| {kind} | {n} |" for kind, n in sorted(tally.kinds.items())),
        "",
        "| minute | " + " | ".join(f"{r} MiB" for r in ROLES) + " |",
        "|---:|" + "---:|" * len(ROLES),
    ]
    step = max(1, len(rows) // 30)
    for t, r in rows[::step] + ([rows[-1]] if (len(rows) - 1) % step else []):
        lines.append(
            f"| {t / 60:.1f} | " + " | ".join(f"{r.get(x, 0) / 2**20:.0f}" for x in ROLES) + " |"
        )
    if tally.errors:
        lines += ["", "## Errors (first 20)", "", *(f"- {e}" for e in tally.errors[:20])]
    out.write_text("\n".join(lines) + "\n")


def models(root: Path):
    from specsplit.edge.export.exporter import export_onnx
    from specsplit.shared.tiny import make_tiny_qwen2, reference_greedy

    target = make_tiny_qwen2(root / "target", seed=0)
    draft_onnx = export_onnx(make_tiny_qwen2(root / "draft", seed=1), root / "draft-onnx")
    rng = random.Random(0)
    prompts = [
        [rng.randrange(1, 256) for _ in range(rng.randrange(4, 200))] for _ in range(PROMPTS)
    ]
    references = [reference_greedy(target, p, MAX_NEW) for p in prompts]
    return target, draft_onnx, prompts, references


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--sample-s", type=float, default=5.0, help="seconds between RSS samples")
    p.add_argument("--warmup", type=float, default=0.2, help="fraction of the run")
    p.add_argument("--max-growth-mib", type=float, default=50.0)
    p.add_argument("--out", type=Path, default=HERE.parent / "docs" / "soak.md")
    args = p.parse_args(argv)
    args.argv = ["python -m bench.soak", *(sys.argv[1:] if argv is None else argv)]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        console.print("making tiny models ...")
        target, draft_onnx, prompts, references = models(root)
        # Headroom over --sessions: a cancelled stream holds its place until the gateway sees the
        # cancel, a moment after the worker has already opened its next one.
        limit = ["--max-sessions", str(args.sessions + 16)]
        with CloudProcess("--target", str(target), *limit, log_dir=root) as cloud:
            sampler = Sampler(cloud.proc.pid, args.sample_s)
            sampler.start()
            tally = Tally()
            t0 = time.monotonic()
            deadline = t0 + args.minutes * 60
            console.print(f"{args.sessions} sessions for {args.minutes:g} min on {cloud.address}")

            async def run() -> None:
                await asyncio.gather(
                    *(
                        worker(j, cloud.address, draft_onnx, prompts, references, deadline, tally)
                        for j in range(args.sessions)
                    )
                )

            asyncio.run(run())
            elapsed = time.monotonic() - t0
            time.sleep(args.sample_s)  # one sample after the last session ended
            sampler.stop.set()
            sampler.join()
            if cloud.proc.poll() is not None:
                tally.errors.append(f"serve exited with {cloud.proc.returncode}")
    grown = growth(sampler.rows, args.warmup * args.minutes * 60)
    failed = bool(tally.errors) or any(g > args.max_growth_mib for g in grown.values())
    write_report(args.out, args, tally, sampler.rows, grown, elapsed, failed)
    console.print(args.out.read_text())
    if failed:
        console.print(f"[red]SOAK FAILED[/red]: {len(tally.errors)} errors, growth {grown}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
