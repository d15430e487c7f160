"""`make demo`: a real 0.5B draft and a real 1.5B target generate code together.

Fetches and converts the default pair on first run (cached afterwards), starts the cloud (Triton +
gateway) on its own cores, streams a split generation live, then compares split, cloud-only and
edge-only on the same prompt, and stops everything, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from specsplit.cloud.supervision.process import CloudProcess
from specsplit.edge.cli import PRECISION_TAGS, _add_precision_arg
from specsplit.edge.client import GenerationConfig, SplitClient
from specsplit.shared.sampling import SamplingConfig

DEFAULT_PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring."
console = Console(stderr=True)


def interrupt_on_sigterm() -> None:
    """SIGTERM and SIGINT both raise KeyboardInterrupt, so the cleanup paths run.

    SIGINT is re-armed too: a program started in the background by a non-interactive shell
    inherits it ignored, and would then ignore Ctrl-C style stops entirely.
    """

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def split_cores() -> tuple[set[int], set[int]]:
    """(edge cores, cloud cores): disjoint halves, so neither steals the other's CPU."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return set(cores), set(cores)
    half = len(cores) // 2
    return set(cores[:half]), set(cores[half:])


def pinned_cloud(target_dir, cores: set[int], log_dir: Path, *args: str) -> CloudProcess:
    """``specsplit-cloud serve`` of ``target_dir`` pinned to ``cores`` with a thread each (not
    started yet); ``args``: more serve flags."""
    return CloudProcess(
        "--target",
        str(target_dir),
        "--threads",
        str(len(cores)),
        *args,
        log_dir=log_dir,
        cpus=cores,
    )


def _status(gen) -> str:
    s = gen.stats
    elapsed = s.token_times_s[-1] if s.token_times_s else 0.0
    rate = len(gen.token_ids) / elapsed if elapsed else 0.0
    return (
        f"{len(gen.token_ids)} tokens  {rate:5.1f} tok/s  acceptance {s.acceptance_rate:.2f}  "
        f"{s.tokens_per_round:.2f} tokens/round"
    )


async def stream_split(client, prompt, cfg, codec):
    gen = client.generate(prompt, cfg, route="split")
    decoder = codec.stream()
    text = Text()
    with Live(console=console, refresh_per_second=8, vertical_overflow="visible") as live:
        async for chunk in gen:
            text.append(decoder.push(chunk))
            live.update(Group(text, Text(_status(gen), style="bold cyan")))
    console.print()
    return gen


async def run_quiet(client, prompt, cfg, mode):
    with console.status(f"running {mode} on the same prompt ..."):
        gen = client.generate(prompt, cfg, route=mode)
        await gen.collect()
    return gen


def comparison(results: dict, greedy: bool) -> Table:
    table = Table(title="same prompt, three ways")
    for col in (
        "mode",
        "tokens",
        "tok/s",
        "speedup",
        "target passes/token",
        "acceptance",
        "= target output",
    ):
        table.add_column(col, justify="right")
    reference = results["cloud-only"].token_ids
    base = results["cloud-only"].stats.tokens_per_s
    for mode, gen in results.items():
        s = gen.stats
        same = ("yes" if gen.token_ids == reference else "NO") if greedy else "n/a (sampled)"
        passes = s.target_forward_passes / s.new_tokens if s.new_tokens else 0.0
        table.add_row(
            mode,
            str(s.new_tokens),
            f"{s.tokens_per_s:.2f}",
            f"{s.tokens_per_s / base:.2f}x",
            f"{passes:.2f}",
            f"{s.acceptance_rate:.2f}" if mode == "split" else "-",
            same,
        )
    return table


async def demo(args, address: str, draft_dir: Path, edge_threads: int) -> None:
    from specsplit.edge.onnx_drafter import OnnxDrafter
    from specsplit.edge.text import TextCodec

    codec = TextCodec(draft_dir)
    prompt = codec.chat_prompt(args.prompt)
    cfg = GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        sampling=SamplingConfig(temperature=args.temperature),
        seed=args.seed,
        max_draft_tokens=args.k,
    )
    drafter = OnnxDrafter(draft_dir, threads=edge_threads)
    console.rule(f"[bold]split: {args.prompt}")
    async with SplitClient(address, drafter) as client:
        results = {"split": await stream_split(client, prompt, cfg, codec)}
        if not args.no_compare:
            results["cloud-only"] = await run_quiet(client, prompt, cfg, "cloud-only")
            results["edge-only"] = await run_quiet(client, prompt, cfg, "edge-only")
    if not args.no_compare:
        results = {m: results[m] for m in ("split", "cloud-only", "edge-only")}
        console.print(comparison(results, greedy=args.temperature == 0))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="make demo", description=__doc__)
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--k", type=int, default=4, help="draft tokens per round")
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", help="name or HF dir")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct", help="name, HF or ONNX dir")
    _add_precision_arg(p, "the draft's weights, as the edge ships them", prog="make demo")
    p.add_argument("--no-compare", action="store_true", help="skip the cloud-only/edge-only runs")
    args = p.parse_args(argv)
    interrupt_on_sigterm()

    from specsplit.edge.export.ensure import ensure_draft_onnx
    from specsplit.shared.weights.sources import resolve_model

    t0 = time.monotonic()
    console.rule("[bold]models")
    target_dir = resolve_model(args.target)
    draft_dir = ensure_draft_onnx(args.draft, PRECISION_TAGS[args.precision])
    console.print(f"target {target_dir}\ndraft  {draft_dir} ({args.precision})")
    edge_cores, cloud_cores = split_cores()
    os.sched_setaffinity(0, edge_cores)
    console.print(f"edge on cores {sorted(edge_cores)}, cloud on cores {sorted(cloud_cores)}")
    try:
        with tempfile.TemporaryDirectory(prefix="specsplit-demo-") as logs:
            with console.status("starting the cloud (Triton + gateway) ..."):
                cloud = pinned_cloud(target_dir, cloud_cores, Path(logs)).start()
            try:
                console.print(f"cloud ready on {cloud.address} after {time.monotonic() - t0:.0f}s")
                asyncio.run(demo(args, cloud.address, draft_dir, len(edge_cores)))
            finally:
                with console.status("stopping the cloud ..."):
                    cloud.stop()
    except KeyboardInterrupt:
        console.print("\n[yellow]interrupted: cloud stopped[/yellow]")
        return 130
    console.print(f"total {time.monotonic() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
