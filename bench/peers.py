"""`make bench-peers`: specsplit next to what a user would run instead, on the same CPU, in one run.

Rows, all greedy, the same chat-templated prompt token ids, the same number of new tokens at
most, every row stopping at the models' end tokens (as specsplit does):

- llama.cpp's llama-server at its defaults (``bench.llama_cpp.with_fallback``: ``--no-repack``
  only where the defaults crash, and the row says so): the target alone on the cloud's core and
  on every core; speculative with the draft (``-md``) for each draft length in
  ``PeersPlan.draft_maxes`` (the report shows the best); and ``-np N -t 1`` on the cloud's core
  with N requests at once.
- transformers (float32): the target alone on one core, assisted generation on two.
- specsplit on one cloud (target on the cloud's core): cloud-only and split, each from a warm
  client (one client in this process, after a warm-up) and from cold clients (a new
  ``specsplit-edge generate`` process per prompt, default flags); and N concurrent sessions of
  each, the split's drafts being the real draft's blocks replayed (``bench.replay`` and
  ``bench.load``'s priming and generation config).

The GGUFs are the project's own Q4_K_M files (llama.cpp reads them natively; transformers and
specsplit read their dequantised conversion). Tokens/s is measured at the client, from the
request to its last token, after one untimed warm-up (the cold rows have none); N concurrent
requests are sent in waves of N, and their aggregate is the waves' tokens over the waves' wall.

Writes docs/peers[-quick].md, -raw.jsonl (one record per generation) and -meta.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
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
ENGINES = ("llama.cpp", "transformers", "specsplit")


@dataclass(frozen=True)
class Row:
    engine: str  # llama.cpp | transformers | specsplit
    variant: str  # target | speculative | assisted | cloud-only | split
    cores: tuple[int, ...]
    draft_max: int = 0  # llama.cpp speculative only
    sessions: int = 1  # requests in flight at once (llama.cpp: as many slots, -np)
    cold: bool = False  # specsplit: a new `specsplit-edge generate` process per prompt

    @property
    def threads(self) -> int:
        return len(self.cores)

    @property
    def key(self) -> str:
        key = f"{self.engine}/{self.variant}/t{self.threads}"
        key += f"/n{self.draft_max}" if self.draft_max else ""
        key += f"/x{self.sessions}" if self.sessions > 1 else ""
        return key + ("/cold" if self.cold else "")


@dataclass(frozen=True)
class PeersPlan:
    prompt_ids: tuple[str, ...]
    max_new_tokens: int
    draft_maxes: tuple[int, ...] = (2, 4, 8, 16)
    sessions: int = 4  # the concurrent rows' requests in flight
    all_peers: bool = True  # False: no llama.cpp alone on every core, no transformers


PLANS = {
    # Outputs that run past 64 tokens, so every row generates the same count.
    "full": PeersPlan(("code-00", "code-07", "code-13", "prose-00", "prose-05", "prose-07"), 64),
    # Every kind of row but the two slowest peers, one prompt, two draft lengths: minutes once
    # llama-server is built and the cloud's weights cached, most of them loading servers.
    "quick": PeersPlan(("code-00",), 16, draft_maxes=(2, 4), all_peers=False),
}


@dataclass(frozen=True)
class Setup:
    """Everything the rows share: what runs, on which cores, with which files."""

    plan: PeersPlan
    prompts: list[dict]  # bench/prompts.jsonl entries plus "ids" (chat-templated) and "seed"
    models: dict[str, Path]  # target_gguf, draft_gguf, target_hf, draft_hf, onnx
    binary: Path | None  # llama-server (None: no llama.cpp row runs)
    flags: tuple[str, ...]  # llama-server's speculative flags (llama_cpp.spec_flags)
    no_repack: bool  # asked for: skip llama.cpp's defaults
    edge_cores: set[int]
    cloud_cores: set[int]
    logs: Path


def make_rows(plan: PeersPlan, one: tuple[int, ...], both: tuple[int, ...]) -> list[Row]:
    """``one``: the target's core (the cloud's half); ``both``: every core."""
    n = plan.sessions
    llama = [Row("llama.cpp", "target", one)]
    llama += [Row("llama.cpp", "target", both)] if plan.all_peers else []
    llama += [Row("llama.cpp", "speculative", both, d) for d in plan.draft_maxes]
    llama += [Row("llama.cpp", "target", one, sessions=n)]
    hf = [Row("transformers", "target", one), Row("transformers", "assisted", both)]
    ours = [
        Row("specsplit", "cloud-only", one),
        Row("specsplit", "split", both),
        Row("specsplit", "cloud-only", one, cold=True),
        Row("specsplit", "split", both, cold=True),
        Row("specsplit", "cloud-only", one, sessions=n),
        Row("specsplit", "split", both, sessions=n),
    ]
    return llama + (hf if plan.all_peers else []) + ours


def waves(prompts: Sequence[dict], n: int) -> list[list[dict]]:
    """The prompts in groups of ``n`` sent at once, cycling so every group is full and every
    prompt is sent at least once."""
    count = -(-len(prompts) // n)
    return [[prompts[(w * n + j) % len(prompts)] for j in range(n)] for w in range(count)]


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


def llama_command(row: Row, setup: Setup, port: int, extra: Sequence[str] = ()) -> list[str]:
    m = setup.models
    draft = m["draft_gguf"] if row.variant == "speculative" else None
    return llama_cpp.server_command(
        setup.binary,
        m["target_gguf"],
        port,
        row.threads,
        draft,
        row.draft_max,
        setup.flags,
        extra,
        parallel=row.sessions,
    )


def llama_generations(server: llama_cpp.LlamaServer, row: Row, setup: Setup) -> Iterator[dict]:
    prompts, n = setup.prompts, setup.plan.max_new_tokens
    server.complete(prompts[0]["ids"], WARMUP_TOKENS)
    if row.sessions == 1:
        for p in prompts:
            out, wall = server.complete(p["ids"], n)
            yield record(row, p, out["tokens"], wall, **llama_extra(out))
        return
    for w, group in enumerate(waves(prompts, row.sessions)):
        answers, wave_wall = server.complete_concurrently([p["ids"] for p in group], n)
        for p, (out, wall) in zip(group, answers, strict=True):
            extra = {"wave": w, "wave_wall_s": wave_wall, **llama_extra(out)}
            yield record(row, p, out["tokens"], wall, **extra)


def llama_extra(out: dict) -> dict:
    return {"stop_type": out.get("stop_type"), **out.get("timings", {})}


def run_llama(row: Row, setup: Setup) -> Iterator[dict]:
    """The row at llama.cpp's defaults, rerun with --no-repack only if that crashes; its
    generations come once the row is done (a crashed attempt's never reach the report)."""
    log = setup.logs / f"llama-{row.key.replace('/', '-')}.log"

    def attempt(extra: tuple[str, ...]) -> tuple[list[str], list[dict]]:
        port = free_port()
        cmd = llama_command(row, setup, port, extra)
        with llama_cpp.LlamaServer(cmd, port, set(row.cores), log) as server:
            return cmd, list(llama_generations(server, row, setup))

    if setup.no_repack:
        (cmd, records), weights = attempt((llama_cpp.NO_REPACK,)), llama_cpp.ASKED
    else:
        (cmd, records), weights = llama_cpp.with_fallback(attempt)
    yield {"command": cmd, "weights": weights}
    for r in records:
        yield {**r, "weights": weights}


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
# the run


def prepare_models() -> dict[str, Path]:
    from specsplit.edge.export.ensure import ensure_draft_onnx
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
    return [
        # the seed as bench.load derives it (greedy rows never draw from it)
        {**by_id[i], "ids": codec.chat_prompt(by_id[i]["prompt"]), "seed": zlib.crc32(i.encode())}
        for i in plan.prompt_ids
    ]


def generations(rows: list[Row], setup: Setup, meta: dict) -> Iterator[tuple[Row, dict]]:
    """(row, record) as each generation finishes; a record without "prompt_id" describes the
    row (its command). A row that fails yields {"error": ...} and the run goes on."""
    # imported here: it imports this module's Row and Setup
    from bench.peers_specsplit import run_specsplit

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
        yield from run_specsplit(ours, setup, meta)
    except Exception as exc:
        logger.exception("specsplit failed")
        yield from ((row, {"error": f"{type(exc).__name__}: {exc}"}) for row in ours)


def measure(rows: list[Row], setup: Setup, raw: Path, meta: dict) -> None:
    """Runs every row, appending each generation to ``raw`` as it finishes."""
    cpu = meta["cpu"]
    with raw.open("w") as out, contextlib.closing(generations(rows, setup, meta)) as gens:
        for row, r in gens:
            if "prompt_id" not in r:
                meta["rows"][row.key].update(r)
                continue
            out.write(json.dumps({**r, "cpu": cpu}) + "\n")
            out.flush()
            console.print(f"{row.key:30s} {r['prompt_id']:9s} {r['tok_s']:6.2f} tok/s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="make bench-peers", description=__doc__)
    p.add_argument(
        "--quick",
        action="store_true",
        help="the subset (minutes): one prompt, 16 tokens, draft lengths 2 and 4, no "
        "transformers rows, no llama.cpp alone on every core",
    )
    p.add_argument("--max-new-tokens", type=int, help="override the plan's length")
    p.add_argument(
        "--no-repack",
        action="store_true",
        help="llama.cpp without its repacked weights in every row (default: its defaults, and "
        "--no-repack only for a row whose server crashes at them)",
    )
    p.add_argument(
        "--engines",
        nargs="+",
        choices=ENGINES,
        default=ENGINES,
        help="run only these engines' rows (default: all; without llama.cpp nothing is built)",
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
    edge_cores, cloud_cores = split_cores()
    rows = make_rows(plan, tuple(sorted(cloud_cores)), tuple(sorted(os.sched_getaffinity(0))))
    rows = [r for r in rows if r.engine in args.engines]
    llama = any(r.engine == "llama.cpp" for r in rows)
    if llama and (missing := llama_cpp.missing_build_tools()):  # before any model is fetched
        print(f"make bench-peers: {missing}", file=sys.stderr)
        return 1
    models = prepare_models()
    binary = llama_cpp.ensure_llama_server() if llama else None
    t0 = time.monotonic()
    logs = Path(tempfile.mkdtemp(prefix="specsplit-peers-"))
    flags = llama_cpp.spec_flags(llama_cpp.server_help(binary) if binary else "")
    prompts = encoded_prompts(plan, models["target_hf"])
    no_repack = args.no_repack
    setup = Setup(plan, prompts, models, binary, flags, no_repack, edge_cores, cloud_cores, logs)
    meta = run_meta(plan, rows, models, setup)
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
