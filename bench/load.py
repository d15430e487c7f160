"""`make bench-load`: one cloud, N concurrent edge sessions, split vs cloud-only, side by side.

For N in {1, 2, 4, 8, 16, 32}, each mode and temperature, N closed-loop workers generate
back to back (code prompts, chat template, the default pair); tokens are counted over a fixed
steady window that starts once every session has its first token (so the prefill burst of N
simultaneous arrivals stays out of it; later prefills, as generations end and restart, count).
The target is pinned to its own core as in `make bench`; the edges run on the other core and
replay recorded drafts (``bench.replay``), so drafting is never the bottleneck. Before
measuring, one session per temperature runs live and replayed and their Drafts are compared.

Every generation is appended to ``docs/load[-quick]-raw.jsonl`` as it finishes; the report
(``docs/load.md`` and ``docs/load.png``) is written by ``bench.load_report``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import sys
import tempfile
import time
import zlib
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from rich.console import Console

from bench.demo import interrupt_on_sigterm, pinned_cloud, split_cores
from bench.replay import LoggingDrafter, ReplayDrafter
from bench.stamp import stamp
from specsplit.edge.client import GenerationConfig, SplitClient
from specsplit.shared.sampling import SamplingConfig

HERE = Path(__file__).parent
console = Console(stderr=True)
K = 4  # the edge's own block size (as in `make demo`); the cloud's hint may lower it


@dataclass(frozen=True)
class LoadPlan:
    sessions: tuple[int, ...]
    temperatures: tuple[float, ...]
    window_s: float  # the steady window, from the moment every session has its first token
    max_new_tokens: int
    prompts: int
    ramp_limit_s: float = 180.0  # the first tokens of all N sessions must come within this


PLANS = {
    "full": LoadPlan((1, 2, 4, 8, 16, 32), (0.0, 0.7), 40.0, 128, 8),
    "quick": LoadPlan((1, 4, 16), (0.0,), 15.0, 64, 4),
}


def code_prompts(n: int) -> list[dict]:
    lines = (HERE / "prompts.jsonl").read_text().splitlines()
    return [p for p in map(json.loads, lines) if p["class"] == "code"][:n]


def gen_config(temperature: float, seed: int, max_new: int) -> GenerationConfig:
    return GenerationConfig(
        max_new_tokens=max_new,
        sampling=SamplingConfig(temperature=temperature),
        seed=seed,
        max_draft_tokens=K,
        # lock-step with a fixed k: the replayed blocks are recorded per round of k
        adaptive=False,
        session_mode="lock-step",
    )


async def one(address, drafter, ids, cfg, mode, started: list) -> None:
    async with SplitClient(address, drafter) as client:
        gen = client.generate(ids, cfg, route=mode)
        started.append((time.perf_counter(), gen))
        await gen.collect()


async def window(address, drafters, prompts, mode, temperature, n, plan):
    """n closed-loop workers; once every worker's first generation has its first token (the
    prefill burst of N simultaneous arrivals is over), counts a steady window of
    plan.window_s. Returns (steady start, [(start, Generation), ...]); times are perf_counter."""
    started: list = []
    stop = asyncio.Event()

    async def worker(j: int) -> None:
        i = j
        while not stop.is_set():
            p = prompts[i % len(prompts)]
            i += n
            cfg = gen_config(temperature, p["seed"], plan.max_new_tokens)
            task = asyncio.ensure_future(
                one(address, drafters[temperature], p["ids"], cfg, mode, started)
            )
            stopped = asyncio.ensure_future(stop.wait())
            await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                task.cancel()
            stopped.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    workers = [asyncio.ensure_future(worker(j)) for j in range(n)]
    t_limit = time.perf_counter() + plan.ramp_limit_s
    while time.perf_counter() < t_limit:
        firsts = started[:n]
        if len(firsts) == n and all(g.stats.ttft_s is not None for _, g in firsts):
            break
        await asyncio.sleep(0.05)
    steady = time.perf_counter()
    await asyncio.sleep(plan.window_s)
    stop.set()
    await asyncio.gather(*workers)
    return steady, started


def record(mode, temperature, n, t0, start, gen) -> dict:
    s = gen.stats
    return {
        "mode": mode,
        "temperature": temperature,
        "sessions": n,
        "start_s": start - t0,
        "token_times_s": [start - t0 + t for t in s.token_times_s],
        "ttft_s": s.ttft_s,
        "finished": bool(s.finish),
        **{k: getattr(s, k) for k in ("rounds", "drafted", "accepted", "new_tokens")},
        "batch_sessions": s.batch_sessions,
        "batch_rows": s.batch_rows,
        "block_hint": s.max_draft_tokens_hint,
    }


async def prime(address, replays, prompts, plan, live) -> dict:
    """Records the blocks every measured session will replay, and checks replay == live."""
    checks = {}
    for temperature, replay in replays.items():
        with console.status(f"recording drafts, T={temperature} ..."):
            replay.greedy = False  # record misses live while priming
            for p in prompts:
                cfg = gen_config(temperature, p["seed"], plan.max_new_tokens)
                async with SplitClient(address, replay) as client:
                    out = await client.generate(p["ids"], cfg).collect()
                if temperature == 0:  # every prefix of the greedy output, for any k
                    for i in range(len(out) + 1):
                        prefix = [*p["ids"], *out[:i]]
                        if tuple(prefix) not in replay.blocks:
                            replay.record(prefix, cfg.sampling, None, cfg.q_entries, cfg.q_levels)
            replay.greedy = temperature == 0
        checks[temperature] = await compare_live(
            address, replay, live, prompts[0], plan, temperature
        )
    return checks


async def compare_live(address, replay, live, p, plan, temperature) -> dict:
    """One session live and one replayed: same Draft blocks (tokens and q supports), same text."""
    cfg = gen_config(temperature, p["seed"], plan.max_new_tokens)
    logged = LoggingDrafter(live)
    async with SplitClient(address, logged) as client:
        live_out = await client.generate(p["ids"], cfg).collect()
    replay.log = []
    try:
        async with SplitClient(address, replay) as client:
            replay_out = await client.generate(p["ids"], cfg).collect()
        replayed = {f[0]: f for f in replay.log if f[1]}
    finally:
        replay.log = None
    # Blocks drafted ahead for a wrong guess are never sent; compare the blocks of real prefixes.
    sent = {f[0]: f for f in logged.log}
    common = sorted(set(sent) & set(replayed))
    same = sum(sent[i][1] == replayed[i][1] and sent[i][2] == replayed[i][2] for i in common)
    return {
        "same_output": live_out == replay_out,
        "blocks_compared": len(common),
        "blocks_identical": same,
    }


async def measure(address, replays, prompts, plan, raw: Path) -> None:
    with raw.open("a") as out:
        for temperature in plan.temperatures:
            for n in plan.sessions:
                for mode in ("split", "cloud-only"):
                    console.print(f"T={temperature} N={n:2d} {mode:10s} ...", end="")
                    t0, started = await window(
                        address, replays, prompts, mode, temperature, n, plan
                    )
                    rows = [record(mode, temperature, n, t0, s, g) for s, g in started]
                    for r in rows:
                        out.write(json.dumps(r) + "\n")
                    out.flush()
                    toks = sum(0 <= t <= plan.window_s for r in rows for t in r["token_times_s"])
                    console.print(f" {toks / plan.window_s:6.1f} tok/s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="make bench-load", description=__doc__)
    p.add_argument("--quick", action="store_true", help="N in {1, 4, 16}, greedy, minutes")
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--out", type=Path, default=HERE.parent / "docs")
    p.add_argument(
        "--temperatures",
        type=float,
        nargs="+",
        help="rerun only these temperatures, keeping the other rows of the existing raw file",
    )
    args = p.parse_args(argv)
    interrupt_on_sigterm()

    from bench.load_report import write_load_report
    from specsplit.edge.export.ensure import ensure_draft_onnx
    from specsplit.edge.onnx_drafter import OnnxDrafter
    from specsplit.edge.text import TextCodec
    from specsplit.shared.weights.sources import resolve_model

    plan = PLANS["quick" if args.quick else "full"]
    if args.temperatures:
        plan = replace(plan, temperatures=tuple(args.temperatures))
    name = "load-quick" if args.quick else "load"
    args.out.mkdir(parents=True, exist_ok=True)
    raw, meta_path = args.out / f"{name}-raw.jsonl", args.out / f"{name}-meta.json"
    kept, before = [], {}
    if args.temperatures and raw.exists() and meta_path.exists():
        rows = [json.loads(line) for line in raw.read_text().splitlines() if line]
        kept = [r for r in rows if r["temperature"] not in plan.temperatures]
        before = json.loads(meta_path.read_text())
    raw.write_text("".join(json.dumps(r) + "\n" for r in kept))
    target_dir = resolve_model(args.target)
    draft_dir = ensure_draft_onnx(args.draft)
    edge_cores, cloud_cores = split_cores()
    os.sched_setaffinity(0, edge_cores)
    codec = TextCodec(draft_dir)
    prompts = [
        {**q, "ids": codec.chat_prompt(q["prompt"]), "seed": zlib.crc32(q["id"].encode())}
        for q in code_prompts(plan.prompts)
    ]
    meta = {
        **stamp(),
        "target": str(target_dir),
        "draft": str(draft_dir),
        "edge_cores": sorted(edge_cores),
        "cloud_cores": sorted(cloud_cores),
        "plan": asdict(PLANS["quick" if args.quick else "full"]),
        "k": K,
    }
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="specsplit-load-") as logs:
        # --triton-log-dir: its log says which weights the target was served in
        cloud = pinned_cloud(target_dir, cloud_cores, Path(logs), "--triton-log-dir", logs)
        with console.status("starting the cloud ..."):
            cloud.start()
        meta["target_weights"] = served_weights(Path(logs))
        try:
            live = OnnxDrafter(draft_dir, threads=len(edge_cores))
            replays = {t: ReplayDrafter(live, greedy=t == 0) for t in plan.temperatures}

            async def run() -> None:
                checks = await prime(cloud.address, replays, prompts, plan, live)
                meta["replay_check"] = {**before.get("replay_check", {}), **checks}
                console.print(f"replay check: {meta['replay_check']}")
                for r in replays.values():
                    r.hits = r.misses = r.off_path = 0
                await measure(cloud.address, replays, prompts, plan, raw)
                meta["replay"] = before.get("replay", {}) | {
                    str(t): {"hits": r.hits, "misses": r.misses, "off_path": r.off_path}
                    for t, r in replays.items()
                }

            asyncio.run(run())
        except KeyboardInterrupt:
            console.print("[yellow]interrupted: reporting what was measured")
        finally:
            cloud.stop()
    meta["wall_s"] = time.monotonic() - t_start
    meta_path.write_text(json.dumps(meta, indent=1))
    report = write_load_report(raw, meta_path, args.out, name)
    console.print(f"report: {report}")
    return 0


def served_weights(logs: Path) -> str:
    """The target's weights as the cloud logged them at load ("int4", "float bfloat16", ...):
    the default is the calibration's choice on this machine, so the report says which."""
    pattern = re.compile(r"target \S+ on \S+ \((\w+) weights, torch\.(\w+)\)")
    for path in sorted(logs.rglob("*.log")):
        found = pattern.search(path.read_text(errors="replace"))
        if found:
            fmt, dtype = found.groups()
            return fmt if fmt != "float" else f"float {dtype}"
    return "auto (not found in the cloud's log)"


if __name__ == "__main__":
    sys.exit(main())
