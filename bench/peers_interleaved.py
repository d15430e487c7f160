"""`make bench-peers-interleaved`: llama.cpp alone, specsplit cloud-only and the split in turns.

`make bench-peers` runs its rows one after another, minutes apart; on a shared VM a slow spell
can fall on one engine's rows and not another's (2026-11-28: specsplit's cloud-only rows ran
15.53 tok/s against 19.12 the evening before, nothing on the cloud changed, while llama.cpp
moved 16.52 -> 15.82). Here the three single-request setups whose ratios the targets name run
side by side: llama-server (1 thread, at its defaults; ``--no-repack`` only if they crash) and
``specsplit-cloud serve`` both on the cloud's core, idle while the other answers, and a warm
``SplitClient`` in this process, its draft on the edge's core. Every prompt goes to each setup
in turn, the order rotating each repeat, so a slow minute falls on all three alike. Greedy, the
prompts and lengths of ``make bench-peers``; tok/s is new tokens over the wall from each request
to its last token, summed over the prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console

from bench import llama_cpp
from bench.demo import interrupt_on_sigterm, split_cores
from bench.peers import PLANS, encoded_prompts, prepare_models
from bench.peers_report import tok_s
from bench.stamp import stamp
from specsplit.cloud.supervision.triton import free_port

console = Console(stderr=True)
SETUPS = ("llama.cpp", "cloud-only", "split")
LABELS = {
    "llama.cpp": "llama.cpp, target alone, 1 thread (the cloud's core)",
    "cloud-only": "specsplit cloud-only (target on the cloud's core), warm client",
    "split": "specsplit split, defaults (draft on the edge's core), warm client",
}


def turns(repeat: int) -> tuple[str, ...]:
    """The setups' order for one repeat: rotated by one each time."""
    k = repeat % len(SETUPS)
    return SETUPS[k:] + SETUPS[:k]


def summarize(records: list[dict]) -> list[dict]:
    """Per setup, in SETUPS order: new tokens over summed walls, and the ratio to llama.cpp."""
    rates = {}
    for name in SETUPS:
        mine = [r for r in records if r["setup"] == name]
        rates[name] = tok_s(mine) or None  # 0.0 where it ran nothing
    base = rates["llama.cpp"]
    return [
        {
            "setup": name,
            "tok_s": rates[name],
            "vs_llama": rates[name] / base if rates[name] is not None and base else None,
            "generations": sum(r["setup"] == name for r in records),
        }
        for name in SETUPS
    ]


def table(summary: list[dict]) -> str:
    out = ["| setup | generations | tok/s | × llama.cpp |", "|---|---|---|---|"]
    for s in summary:
        rate = "–" if s["tok_s"] is None else f"**{s['tok_s']:.2f}**"
        ratio = "–" if s["vs_llama"] is None else f"{s['vs_llama']:.2f}×"
        out.append(f"| {LABELS[s['setup']]} | {s['generations']} | {rate} | {ratio} |")
    return "\n".join(out)


async def measure(llama, address: str, drafter, prompts: list[dict], n: int, repeats: int):
    """Yields one record per generation, each setup in turn per prompt."""
    from specsplit.edge.client import GenerationConfig, SplitClient

    async with SplitClient(address, drafter) as client:

        async def ours(ids: list[int], route: str, tokens: int) -> tuple[list[int], float]:
            t0 = time.perf_counter()
            gen = client.generate(ids, GenerationConfig(max_new_tokens=tokens), route=route)
            await gen.collect()
            return gen.token_ids, time.perf_counter() - t0

        for route in ("cloud-only", "split"):  # warm-ups, untimed
            await ours(prompts[0]["ids"], route, 8)
        llama.complete(prompts[0]["ids"], 8)
        for repeat in range(repeats):
            for p in prompts:
                for name in turns(repeat):
                    if name == "llama.cpp":
                        out, wall = llama.complete(p["ids"], n)
                        tokens = out["tokens"]
                    else:
                        tokens, wall = await ours(p["ids"], name, n)
                    yield {
                        "setup": name,
                        "repeat": repeat,
                        "prompt_id": p["id"],
                        "new_tokens": len(tokens),
                        "wall_s": wall,
                        "token_ids": tokens,
                    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="make bench-peers-interleaved", description=__doc__)
    p.add_argument("--repeats", type=int, default=2, help="passes over the prompts [2]")
    p.add_argument("--max-new-tokens", type=int, help="override make bench-peers' length [64]")
    p.add_argument("--raw", type=Path, help="also write every generation here (JSON lines)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    logging.basicConfig(level=logging.WARNING)
    interrupt_on_sigterm()
    if missing := llama_cpp.missing_build_tools():
        print(f"make bench-peers-interleaved: {missing}", file=sys.stderr)
        return 1
    from specsplit.cloud.supervision.process import CloudProcess
    from specsplit.edge.onnx_drafter import OnnxDrafter

    plan = PLANS["full"]
    n = args.max_new_tokens or plan.max_new_tokens
    models = prepare_models()
    binary = llama_cpp.ensure_llama_server()
    prompts = encoded_prompts(plan, models["target_hf"])
    edge_cores, cloud_cores = split_cores()
    logs = Path(tempfile.mkdtemp(prefix="specsplit-interleaved-"))
    target = ("--target", str(models["target_hf"]), "--threads", str(len(cloud_cores)))
    cloud = CloudProcess(*target, log_dir=logs, cpus=cloud_cores, timeout_s=900.0)
    records: list[dict] = []

    def attempt(extra: tuple[str, ...]) -> None:
        port = free_port()
        cmd = llama_cpp.server_command(binary, models["target_gguf"], port, 1, extra=extra)
        with llama_cpp.LlamaServer(cmd, port, cloud_cores, logs / "llama-server.log") as llama:
            drafter = OnnxDrafter(models["onnx"], threads=len(edge_cores))
            records.clear()

            async def run() -> None:
                async for r in measure(llama, cloud.address, drafter, prompts, n, args.repeats):
                    records.append(r)
                    tok_s = r["new_tokens"] / r["wall_s"]
                    console.print(f"{r['setup']:10s} {r['prompt_id']:9s} {tok_s:6.2f} tok/s")

            asyncio.run(run())

    with console.status("starting the cloud (Triton + gateway) ..."):
        cloud.start()
    try:
        os.sched_setaffinity(0, edge_cores)  # this process hosts the edge's draft
        _, ran = llama_cpp.with_fallback(attempt)
    finally:
        cloud.stop()
    if args.raw:
        args.raw.write_text("".join(json.dumps(r) + "\n" for r in records))
    s = stamp()
    print(f"{s['date']}, commit {s['commit']}, {s['cpu']}; llama.cpp ran at {ran}; ", end="")
    print(f"cloud cores {sorted(cloud_cores)}, edge cores {sorted(edge_cores)}, {n} new tokens, ")
    print(f"{len(prompts)} prompts x {args.repeats} repeats, the setups taking turns\n")
    print(table(summarize(records)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
