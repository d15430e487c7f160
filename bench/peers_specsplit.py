"""The specsplit rows of `make bench-peers` (``bench.peers``): one cloud, three kinds of client.

- warm: one ``SplitClient`` in this process, kept across prompts as an app keeps one, after an
  untimed warm-up; the project's defaults but the length.
- cold: a new ``specsplit-edge generate`` process per prompt with its default flags (only the
  server, the prompt's token ids, the length, ``--mode`` and ``--json`` given), pinned to the
  edge's cores: what a user who runs the CLI gets on every call. tok/s is the CLI's own (from its
  request to its last token); the process's wall, start-up included, is in the raw records.
- concurrent: N sessions at once in waves (``bench.peers.waves``), each with its own client
  (``bench.load.one``) and ``bench.load.gen_config``; the split's drafts are the real draft's
  blocks, recorded once by ``bench.load.prime`` and replayed (``bench.replay.ReplayDrafter``), so
  N sessions cost the edge's one core nothing and the cloud's core is what is measured.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from bench import load
from bench.peers import WARMUP_TOKENS, Row, Setup, console, record, waves
from bench.replay import ReplayDrafter
from specsplit.cloud.supervision.triton import pinned

GREEDY = 0.0


def stats_extra(s) -> dict:
    """What the report reads from a generation's ``GenerationStats`` (or its CLI summary)."""
    get = s.get if isinstance(s, dict) else lambda k: getattr(s, k)
    # ttft_s: the prompt's pass(es) and the first token; lead_round, led_at_start: where an
    # auto session went cloud-led (0 / False: it stayed lock-step)
    keys = ("drafted", "accepted", "rounds", "ttft_s", "lead_round", "led_at_start")
    return {k: get(k) for k in keys}


async def warm_generations(address: str, drafter, row: Row, setup: Setup) -> list[dict]:
    from specsplit.edge.client import GenerationConfig, SplitClient

    out, prompts = [], setup.prompts
    async with SplitClient(address, drafter) as client:
        cfg = GenerationConfig(max_new_tokens=WARMUP_TOKENS)
        await client.generate(prompts[0]["ids"], cfg, route=row.variant).collect()
        cfg = GenerationConfig(max_new_tokens=setup.plan.max_new_tokens)
        for p in prompts:
            t0 = time.perf_counter()
            gen = client.generate(p["ids"], cfg, route=row.variant)
            await gen.collect()
            wall = time.perf_counter() - t0
            s = gen.stats
            out.append(record(row, p, gen.token_ids, wall, stats_wall_s=s.wall_s, **stats_extra(s)))
    return out


def cli_command(address: str, row: Row, prompt_ids: list[int] | None, n: int) -> list[str]:
    """``specsplit-edge generate`` as a user runs it; ``prompt_ids`` None shows a placeholder."""
    exe = Path(sys.executable).with_name("specsplit-edge")
    ids = "<prompt ids>" if prompt_ids is None else ",".join(map(str, prompt_ids))
    cmd = [str(exe), "generate", "--server", address, "--route", row.variant]
    return cmd + ["--prompt-ids", ids, "--max-new-tokens", str(n), "--json"]


def cold_generations(address: str, row: Row, setup: Setup) -> Iterator[dict]:
    n = setup.plan.max_new_tokens
    for p in setup.prompts:
        cmd = cli_command(address, row, p["ids"], n)
        t0 = time.perf_counter()
        done = subprocess.run(
            pinned(cmd, setup.edge_cores), capture_output=True, text=True, timeout=600
        )
        process_wall = time.perf_counter() - t0
        if done.returncode != 0:
            raise RuntimeError(f"specsplit-edge exited {done.returncode}: {done.stderr[-2000:]}")
        s = json.loads(done.stdout.strip().splitlines()[-1])
        extra = {"process_wall_s": process_wall, **stats_extra(s)}
        yield record(row, p, s["token_ids"], s["wall_s"], **extra)


async def concurrent_generations(address: str, replay, row: Row, setup: Setup) -> list[dict]:
    """Waves of ``row.sessions`` sessions sent at once; every record carries its wave's wall
    (first start to last token), from which the report takes the aggregate."""
    n, prompts = setup.plan.max_new_tokens, setup.prompts

    async def session(p: dict, length: int):
        started: list = []
        cfg = load.gen_config(GREEDY, p["seed"], length)
        await load.one(address, replay, p["ids"], cfg, row.variant, started)
        ((_, gen),) = started
        return gen

    await session(prompts[0], WARMUP_TOKENS)
    out = []
    for w, group in enumerate(waves(prompts, row.sessions)):
        t0 = time.perf_counter()
        gens = await asyncio.gather(*(session(p, n) for p in group))
        wave_wall = time.perf_counter() - t0
        for p, gen in zip(group, gens, strict=True):
            extra = {"wave": w, "wave_wall_s": wave_wall, **stats_extra(gen.stats)}
            out.append(record(row, p, gen.token_ids, gen.stats.wall_s, **extra))
    return out


def run_specsplit(rows: list[Row], setup: Setup, meta: dict) -> Iterator[tuple[Row, dict]]:
    """Every specsplit row on one cloud (target on the cloud's cores, no --dtype: the project's
    default precision), the edge's draft in this process on the other cores. A row that fails
    yields {"error": ...} and the others still run."""
    from specsplit.cloud.supervision.process import CloudProcess
    from specsplit.edge.onnx_drafter import OnnxDrafter

    onnx, cores = setup.models["onnx"], setup.cloud_cores
    args = ("--target", str(setup.models["target_hf"]), "--threads", str(len(cores)))
    # A first start may calibrate the target's kernels at load: minutes on a small CPU.
    log_dir = ("--triton-log-dir", str(setup.logs))
    cloud = CloudProcess(*args, *log_dir, log_dir=setup.logs, cpus=cores, timeout_s=900.0)
    meta["specsplit_cloud"] = ["specsplit-cloud", *cloud.args[:-2]]
    for row in rows:
        in_process = ["(SplitClient in this process, draft", str(onnx) + ")"]
        n = setup.plan.max_new_tokens
        yield row, {"command": cli_command("HOST:PORT", row, None, n) if row.cold else in_process}
    with console.status("starting the cloud (Triton + gateway) ..."):
        cloud.start()
    try:
        drafter = OnnxDrafter(onnx, threads=len(setup.edge_cores))
        replay = None
        for row in rows:
            try:
                if row.sessions > 1 and replay is None:
                    replay = primed_replay(cloud.address, drafter, setup, meta)
                yield from ((row, r) for r in one_row(cloud.address, drafter, replay, row, setup))
            except Exception as exc:  # one row's failure must not cost the others' figures
                console.print_exception()
                yield row, {"error": f"{type(exc).__name__}: {exc}"}
        if replay is not None:
            meta["replay"] = {"hits": replay.hits, "misses": replay.misses, "off": replay.off_path}
    finally:
        cloud.stop()


def one_row(address: str, drafter, replay, row: Row, setup: Setup) -> Iterator[dict]:
    if row.cold:
        yield from cold_generations(address, row, setup)
    elif row.sessions > 1:
        yield from asyncio.run(concurrent_generations(address, replay, row, setup))
    else:
        yield from asyncio.run(warm_generations(address, drafter, row, setup))


def primed_replay(address: str, drafter, setup: Setup, meta: dict) -> ReplayDrafter:
    """The draft's blocks after every prefix the greedy sessions reach, recorded live once;
    ``meta["replay_check"]`` says whether a replayed session sent what a live one sends."""
    replay = ReplayDrafter(drafter, greedy=True)
    plan = setup.plan  # prime reads its max_new_tokens
    checks = asyncio.run(load.prime(address, {GREEDY: replay}, setup.prompts, plan, drafter))
    meta["replay_check"], meta["concurrent_k"] = checks[GREEDY], load.K
    replay.hits = replay.misses = replay.off_path = 0
    return replay
