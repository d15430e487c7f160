"""`make bench-peers`: specsplit next to what a user would run instead, on the same CPU, in one run.

Rows, all greedy, the same chat-templated prompt token ids, the same number of new tokens at
most, every row stopping at the models' end tokens (as specsplit does): llama.cpp's llama-server
with the target alone on 1 and on 2 threads, and speculative with the draft (``-md``) for each
draft length in ``PeersPlan.draft_maxes``; transformers (float32) with the target alone on one core,
and assisted generation on two; specsplit cloud-only (target on one core) and split with its
defaults (draft on the other core). The GGUFs are the project's own Q4_K_M files (llama.cpp reads
them natively; transformers and specsplit read their dequantised conversion). Tokens/s is
measured at the client, from the request to its last token, after one untimed warm-up.

Writes docs/peers[-quick].md, -raw.jsonl (one record per generation) and -meta.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from rich.console import Console
from rich.logging import RichHandler

from bench import llama_cpp
from bench.demo import interrupt_on_sigterm, split_cores
from bench.run import load_prompts
from specsplit.cloud.supervision.triton import free_port, pinned, stop_process_group

HERE = Path(__file__).parent
console = Console(stderr=True)
logger = logging.getLogger(__name__)
WARMUP_TOKENS = 8


@dataclass(frozen=True)
class Row:
    engine: str  # llama.cpp | transformers | specsplit
    variant: str  # target | speculative | assisted | cloud-only | split
    cores: tuple[int, ...]
    draft_max: int = 0  # llama.cpp speculative only

    @property
    def threads(self) -> int:
        return len(self.cores)

    @property
    def key(self) -> str:
        return f"{self.engine}/{self.variant}/t{self.threads}" + (
            f"/n{self.draft_max}" if self.draft_max else ""
        )


@dataclass(frozen=True)
class PeersPlan:
    prompt_ids: tuple[str, ...]
    max_new_tokens: int
    draft_maxes: tuple[int, ...] = (4, 8, 16)


PLANS = {
    # Outputs that run past 64 tokens, so every row generates the same count.
    "full": PeersPlan(("code-00", "code-07", "code-13", "prose-00", "prose-05", "prose-07"), 64),
    "quick": PeersPlan(("code-00",), 16),
}


@dataclass(frozen=True)
class Setup:
    """Everything the rows share: what runs, on which cores, with which files."""

    plan: PeersPlan
    prompts: list[dict]  # bench/prompts.jsonl entries plus "ids": the chat-templated token ids
    models: dict[str, Path]  # target_gguf, draft_gguf, target_hf, draft_hf, onnx
    binary: Path  # llama-server
    flags: tuple[str, str]  # llama-server's draft-length flags (max, min)
    no_repack: bool
    edge_cores: set[int]
    cloud_cores: set[int]
    logs: Path


def make_rows(plan: PeersPlan, one: tuple[int, ...], both: tuple[int, ...]) -> list[Row]:
    """``one``: the target's core (the cloud's half); ``both``: every core."""
    return [
        Row("llama.cpp", "target", one),
        Row("llama.cpp", "target", both),
        *(Row("llama.cpp", "speculative", both, n) for n in plan.draft_maxes),
        Row("transformers", "target", one),
        Row("transformers", "assisted", both),
        Row("specsplit", "cloud-only", one),
        Row("specsplit", "split", both),
    ]


def record(row: Row, prompt: dict, token_ids: list[int], wall_s: float, **extra) -> dict:
    return {
        "row": row.key,
        **asdict(row),
        "threads": row.threads,
        "prompt_id": prompt["id"],
        "class": prompt["class"],
        "prompt_len": len(prompt.get("ids", ())),
        "new_tokens": len(token_ids),
        "wall_s": wall_s,
        "tok_s": len(token_ids) / wall_s if wall_s else 0.0,
        "token_ids": token_ids,
        **extra,
    }


# ---------------------------------------------------------------------------------------------
# llama.cpp


def llama_command(row: Row, setup: Setup, port: int) -> list[str]:
    m = setup.models
    draft = m["draft_gguf"] if row.variant == "speculative" else None
    extra = ["--no-repack"] if setup.no_repack else []
    return llama_cpp.server_command(
        setup.binary, m["target_gguf"], port, row.threads, draft, row.draft_max, setup.flags, extra
    )


def run_llama(row: Row, setup: Setup) -> Iterator[dict]:
    port = free_port()
    cmd = llama_command(row, setup, port)
    yield {"command": cmd}
    log = setup.logs / f"llama-{row.key.replace('/', '-')}.log"
    prompts = setup.prompts
    with llama_cpp.LlamaServer(cmd, port, set(row.cores), log) as server:
        server.complete(prompts[0]["ids"], WARMUP_TOKENS)
        for p in prompts:
            out, wall = server.complete(p["ids"], setup.plan.max_new_tokens)
            timings = out.get("timings", {})
            yield record(row, p, out["tokens"], wall, stop_type=out.get("stop_type"), **timings)


# ---------------------------------------------------------------------------------------------
# transformers


def run_transformers(row: Row, setup: Setup) -> Iterator[dict]:
    ids_file = setup.logs / "prompt-ids.json"
    ids_file.write_text(json.dumps([{"id": p["id"], "ids": p["ids"]} for p in setup.prompts]))
    cmd = [sys.executable, "-m", "bench.peers_hf", "--target", str(setup.models["target_hf"])]
    if row.variant == "assisted":
        cmd += ["--draft", str(setup.models["draft_hf"])]
    cmd += ["--threads", str(row.threads), "--prompts", str(ids_file)]
    cmd += ["--max-new-tokens", str(setup.plan.max_new_tokens)]
    yield {"command": cmd}
    by_id = {p["id"]: p for p in setup.prompts}
    with (setup.logs / f"hf-{row.variant}.log").open("ab") as log:
        proc = subprocess.Popen(
            pinned(cmd, set(row.cores)),
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            cwd=HERE.parent,
            start_new_session=True,
        )
    try:
        for line in proc.stdout:
            r = json.loads(line)
            p = by_id[r.pop("prompt_id")]
            yield record(row, p, r.pop("token_ids"), r.pop("wall_s"), **r)
        if proc.wait() != 0:
            raise RuntimeError(f"bench.peers_hf exited {proc.returncode}, see {log.name}")
    finally:
        stop_process_group(proc, grace_s=10.0, signal_group=True)


# ---------------------------------------------------------------------------------------------
# specsplit


async def specsplit_generations(address: str, drafter, row: Row, setup: Setup) -> list[dict]:
    """One client per mode, as an app keeps one; the project's defaults but the length."""
    from specsplit.edge.client import GenerationConfig, SplitClient

    out, prompts = [], setup.prompts
    async with SplitClient(address, drafter) as client:
        cfg = GenerationConfig(max_new_tokens=WARMUP_TOKENS)
        await client.generate(prompts[0]["ids"], cfg, mode=row.variant).collect()
        cfg = GenerationConfig(max_new_tokens=setup.plan.max_new_tokens)
        for p in prompts:
            t0 = time.perf_counter()
            gen = client.generate(p["ids"], cfg, mode=row.variant)
            await gen.collect()
            wall = time.perf_counter() - t0
            s = gen.stats
            extra = {"drafted": s.drafted, "accepted": s.accepted, "rounds": s.rounds}
            extra["ttft_s"] = s.ttft_s  # the prompt's pass(es) and the first token
            out.append(record(row, p, gen.token_ids, wall, stats_wall_s=s.wall_s, **extra))
    return out


def run_specsplit(rows: list[Row], setup: Setup) -> Iterator[tuple[Row, dict]]:
    """Both specsplit rows on one cloud (target on the cloud's cores, no --dtype: the
    project's default precision), the edge's draft in this process on the other cores."""
    from specsplit.cloud.supervision.process import CloudProcess
    from specsplit.edge.onnx_drafter import OnnxDrafter

    onnx, cores = setup.models["onnx"], setup.cloud_cores
    args = ("--target", str(setup.models["target_hf"]), "--threads", str(len(cores)))
    # A first start may calibrate the target's kernels at load: minutes on a small CPU.
    log_dir = ("--triton-log-dir", str(setup.logs))
    cloud = CloudProcess(*args, *log_dir, log_dir=setup.logs, cpus=cores, timeout_s=900.0)
    for row in rows:
        yield row, {"command": ["specsplit-cloud", *cloud.args[:-2]], "draft": str(onnx)}
    with console.status("starting the cloud (Triton + gateway) ..."):
        cloud.start()
    try:
        drafter = OnnxDrafter(onnx, threads=len(setup.edge_cores))
        for row in rows:
            gens = specsplit_generations(cloud.address, drafter, row, setup)
            for r in asyncio.run(gens):
                yield row, r
    finally:
        cloud.stop()


# ---------------------------------------------------------------------------------------------
# the run


def prepare_models() -> dict[str, Path]:
    from specsplit.edge.models import ensure_draft_onnx
    from specsplit.shared.weights.sources import (
        DRAFT_DEFAULT,
        TARGET_DEFAULT,
        ensure_hf_dir,
        fetch_gguf,
    )

    return {
        "target_gguf": fetch_gguf(TARGET_DEFAULT),
        "draft_gguf": fetch_gguf(DRAFT_DEFAULT),
        "target_hf": ensure_hf_dir(TARGET_DEFAULT),
        "draft_hf": ensure_hf_dir(DRAFT_DEFAULT),
        "onnx": ensure_draft_onnx(),
    }


def encoded_prompts(plan: PeersPlan, target_hf: Path) -> list[dict]:
    from specsplit.edge.text import TextCodec

    codec = TextCodec(target_hf)
    by_id = {p["id"]: p for p in load_prompts()}
    return [{**by_id[i], "ids": codec.chat_prompt(by_id[i]["prompt"])} for i in plan.prompt_ids]


def generations(rows: list[Row], setup: Setup) -> Iterator[tuple[Row, dict]]:
    """(row, record) as each generation finishes; a record without "prompt_id" describes the
    row (its command). A row that fails yields {"error": ...} and the run goes on."""
    engines: dict[str, Callable] = {"llama.cpp": run_llama, "transformers": run_transformers}
    for row in (r for r in rows if r.engine in engines):
        try:
            for r in engines[row.engine](row, setup):
                yield row, r
        except Exception as exc:  # one engine's failure must not cost the others' figures
            logger.exception("%s failed", row.key)
            yield row, {"error": f"{type(exc).__name__}: {exc}"}
    ours = [r for r in rows if r.engine == "specsplit"]
    try:
        yield from run_specsplit(ours, setup)
    except Exception as exc:
        logger.exception("specsplit failed")
        yield from ((row, {"error": f"{type(exc).__name__}: {exc}"}) for row in ours)


def measure(rows: list[Row], setup: Setup, raw: Path, meta: dict) -> None:
    """Runs every row, appending each generation to ``raw`` as it finishes."""
    with raw.open("w") as out, contextlib.closing(generations(rows, setup)) as gens:
        for row, r in gens:
            if "prompt_id" not in r:
                meta["rows"][row.key].update(r)
                continue
            out.write(json.dumps(r) + "\n")
            out.flush()
            console.print(f"{row.key:30s} {r['prompt_id']:9s} {r['tok_s']:6.2f} tok/s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="make bench-peers", description=__doc__)
    p.add_argument("--quick", action="store_true", help="one prompt, 16 tokens: the plumbing")
    p.add_argument("--max-new-tokens", type=int, help="override the plan's length")
    p.add_argument(
        "--no-repack",
        action=argparse.BooleanOptionalAction,
        help="llama.cpp without its repacked weights (default: only if a probe shows that the "
        "repacked path crashes on this CPU)",
    )
    p.add_argument("--out", type=Path, default=HERE.parent / "docs")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", handlers=[RichHandler()])
    interrupt_on_sigterm()
    from bench.peers_report import run_meta, write_report

    plan = PLANS["quick" if args.quick else "full"]
    if args.max_new_tokens:
        plan = replace(plan, max_new_tokens=args.max_new_tokens)
    name = "peers-quick" if args.quick else "peers"
    args.out.mkdir(parents=True, exist_ok=True)
    raw, meta_path = args.out / f"{name}-raw.jsonl", args.out / f"{name}-meta.json"
    binary = llama_cpp.ensure_llama_server()
    models = prepare_models()
    edge_cores, cloud_cores = split_cores()
    rows = make_rows(plan, tuple(sorted(cloud_cores)), tuple(sorted(os.sched_getaffinity(0))))
    t0 = time.monotonic()
    logs = Path(tempfile.mkdtemp(prefix="specsplit-peers-"))
    flags = llama_cpp.spec_flags(llama_cpp.server_help(binary))
    prompts = encoded_prompts(plan, models["target_hf"])
    no_repack, why = args.no_repack, "asked"
    if no_repack is None:
        log = logs / "llama-repack-probe.log"
        no_repack = not llama_cpp.repack_works(binary, models["target_gguf"], cloud_cores, log)
        why = "its repacked-weights path crashed on this CPU in the run's probe"
    setup = Setup(plan, prompts, models, binary, flags, no_repack, edge_cores, cloud_cores, logs)
    meta = run_meta(plan, rows, models, setup) | {"no_repack": why if no_repack else False}
    os.sched_setaffinity(0, edge_cores)  # this process hosts the edge's draft
    try:
        measure(rows, setup, raw, meta)
    except KeyboardInterrupt:
        meta["interrupted"] = True
        console.print("[yellow]interrupted: reporting the generations finished so far")
    if meta.get("interrupted") or any("error" in r for r in meta["rows"].values()):
        console.print(f"[yellow]server logs kept in {logs}")
    else:
        shutil.rmtree(logs, ignore_errors=True)
    meta["wall_s"] = round(time.monotonic() - t0, 1)
    meta_path.write_text(json.dumps(meta, indent=1, default=str))
    console.print(f"report: {write_report(raw, meta_path, args.out / f'{name}.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
