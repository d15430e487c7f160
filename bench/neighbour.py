"""`python -m bench.neighbour`: how much the real draft, stepping on the edge's core, slows the real
target's one-row pass on the cloud's core.

`bench.contention` shows that this VM's cores share memory bandwidth, with synthetic loads. This
measures what the benchmarks pay for it: the cloud as `make bench` runs it (Triton + gateway on
the cloud's cores), cloud-only generations of the bench's prompts, their target passes timed by
the server (Verdict.verify_ms, one row each), while the edge's core is idle and while a second
process there drafts with the real ONNX draft (next_token over and over, as a cloud-led edge does
while it speculates). The two alternate, ``--rounds`` times each, so both see the same minutes.

Where the drafting neighbour makes the pass slower, a split measured on this machine pays its
draft's weight reads in every target pass it drafts beside, which separate machines would not:
the profile behind the default's misses on prose in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.demo import pinned_cloud, split_cores
from bench.run import Config, generate, make_plan

CLOUD_ONLY = Config("cloud-only", 0, 0.0, 0.0)

# The neighbour: a process pinned to the edge's core that drafts token after token with the real
# draft (its KV cache grows; it starts over at ``steps`` tokens), and says "ready" once it drafts.
_DRAFTING = """
import sys
from specsplit.edge.drafting import DraftRule
from specsplit.edge.onnx_drafter import OnnxDrafter
from specsplit.edge.proposer import as_proposer
from specsplit.shared.sampling import SamplingConfig
drafter = as_proposer(OnnxDrafter(sys.argv[1], threads=1))
prompt, steps = [int(t) for t in sys.argv[2].split(",")], int(sys.argv[3])
rule = DraftRule(SamplingConfig(temperature=0.0), None)
tokens = list(prompt)
token, _ = drafter.next_token(tokens, rule)
print("ready", flush=True)
while True:
    tokens.append(token)
    if len(tokens) - len(prompt) >= steps:
        tokens = list(prompt)
    token, _ = drafter.next_token(tokens, rule)
"""


def _drafting(draft_dir: Path, core: int, prompt: list[int], steps: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", _DRAFTING, str(draft_dir), ",".join(map(str, prompt)), str(steps)],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: os.sched_setaffinity(0, {core}),
    )
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        proc.wait()
        raise RuntimeError(f"the drafting neighbour failed (exit {proc.poll()})")
    return proc


async def _cloud_only(address: str, prompts: list[dict], max_new: int) -> tuple[list, float]:
    """One cloud-only generation per prompt, as `make bench` runs one: the server's pass times
    (ms) and tokens/s."""
    passes, tokens, wall = [], 0, 0.0
    for p in prompts:
        gen, _ = await generate(address, None, p["prompt_ids"], CLOUD_ONLY, max_new, seed=0)
        passes += gen.stats.verify_ms
        tokens, wall = tokens + gen.stats.new_tokens, wall + gen.stats.wall_s
    return passes, tokens / wall


def measure(
    address: str,
    draft_dir: Path,
    edge_core: int,
    prompts: list[dict],
    rounds: int,
    max_new: int,
    log=print,
) -> dict:
    """Alternates idle and drafting neighbours ``rounds`` times each; per kind, every pass time
    (ms) and each round's tokens/s."""
    out = {"idle": {"pass_ms": [], "tok_s": []}, "drafting": {"pass_ms": [], "tok_s": []}}
    for r in range(rounds):
        for kind in ("idle", "drafting"):
            neighbour = None
            try:
                if kind == "drafting":
                    neighbour = _drafting(draft_dir, edge_core, prompts[0]["prompt_ids"], 256)
                    time.sleep(0.5)
                passes, tok_s = asyncio.run(_cloud_only(address, prompts, max_new))
            finally:
                if neighbour is not None:
                    neighbour.kill()
                    neighbour.wait()
            out[kind]["pass_ms"] += passes
            out[kind]["tok_s"].append(tok_s)
            log(
                f"round {r + 1}/{rounds} {kind}: pass median {statistics.median(passes):.1f} ms, "
                f"{tok_s:.2f} tok/s"
            )
    return out


def table(result: dict) -> str:
    idle = result["idle"]
    base_ms, base_tok = statistics.median(idle["pass_ms"]), statistics.mean(idle["tok_s"])
    lines = [
        "| edge core | target pass (1 row), median ms | x idle | cloud-only tok/s | x idle |",
        "|---|---|---|---|---|",
    ]
    for kind, r in result.items():
        ms, tok = statistics.median(r["pass_ms"]), statistics.mean(r["tok_s"])
        lines.append(
            f"| {kind} | {ms:.1f} | {ms / base_ms:.2f} | {tok:.2f} | {tok / base_tok:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.neighbour", description=__doc__)
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--rounds", type=int, default=3, help="idle / drafting alternations")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--out", type=Path, help="also write the result here as JSON")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.max_new_tokens < 1:
        p.error("--rounds and --max-new-tokens must be >= 1")

    from specsplit.edge.export.ensure import ensure_draft_onnx
    from specsplit.edge.text import TextCodec
    from specsplit.shared.weights.sources import resolve_model

    target_dir = resolve_model(args.target)
    draft_dir = ensure_draft_onnx(args.draft, "int4")
    edge_cores, cloud_cores = split_cores()
    os.sched_setaffinity(0, edge_cores)
    codec = TextCodec(draft_dir)
    prompts = [
        {**p, "prompt_ids": codec.chat_prompt(p["prompt"])} for p in make_plan(False, None).prompts
    ]
    print(f"starting the cloud on cores {sorted(cloud_cores)} ...", flush=True)
    with (
        tempfile.TemporaryDirectory(prefix="specsplit-neighbour-") as logs,
        pinned_cloud(target_dir, cloud_cores, Path(logs)) as cloud,
    ):
        result = measure(
            cloud.address,
            draft_dir,
            min(edge_cores),
            prompts,
            args.rounds,
            args.max_new_tokens,
            log=lambda s: print(s, flush=True),
        )
    print(table(result))
    if args.out:
        args.out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
