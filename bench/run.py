"""`make bench`: split vs cloud-only vs edge-only, side by side in one run, with emulated RTT.

One cloud process (Triton + gateway) pinned to half the cores, the edge (drafter, client, delay
proxy) pinned to the other half, the same thread counts in every mode. For each temperature and
RTT, every mode runs over the same prompts before the next RTT, so the compared figures come from
the same minutes of the same machine. Each generation is appended to the raw JSONL as soon as it
finishes: an interrupted run loses nothing, and ``--resume`` continues it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from bench.demo import interrupt_on_sigterm, pinned_cloud, split_cores
from bench.proxy import DelayProxy
from bench.stamp import stamp
from specsplit.edge.cli import PRECISION_TAGS, _add_precision_arg
from specsplit.edge.client import GenerationConfig, SplitClient
from specsplit.edge.link_memory import load_link, save_link
from specsplit.edge.mode_switch import Link
from specsplit.shared.sampling import SamplingConfig

HERE = Path(__file__).parent
console = Console(stderr=True)


LTE = {"rtt_ms": 50.0, "jitter_ms": 10.0, "up_bps": 5e6, "down_bps": 20e6}  # a phone on LTE
SPLIT_MODES = ("lock-step", "lock-step-adaptive", "cloud-led", "auto", "auto-warm")
# The client's session mode per bench mode (lock-step for the rest); these run as with no seed.
SESSION_MODE = {"cloud-led": "cloud-led", "auto": "auto", "auto-warm": "auto"}
MODES = ("edge-only", "cloud-only", *SPLIT_MODES)


@dataclass(frozen=True)
class Config:
    # cloud-only, edge-only, lock-step (fixed k), lock-step-adaptive / cloud-led / auto (k <= k;
    # auto: the default session mode, lock-step until it measures cloud-led to be faster) /
    # auto-warm (auto on a new client given the link its cell's last auto run measured, saved
    # to and read back from a link-memory file (edge.link_memory): what the CLI's next process
    # or an app's second generation gets; auto is the cold client, no link in memory)
    mode: str
    k: int  # 0 for cloud-only / edge-only; the fixed k, or the adaptive modes' maximum
    temperature: float
    rtt_ms: float
    link: str = ""  # "" = latency only; "lte" = LTE above (its rtt_ms is LTE's)

    @property
    def key(self) -> str:
        link = f"/{self.link}" if self.link else ""
        return f"{self.mode}/k{self.k}/t{self.temperature}/rtt{self.rtt_ms:g}{link}"


@dataclass(frozen=True)
class BenchPlan:
    ks: tuple[int, ...]  # fixed k of lock-step
    k_max: int  # the adaptive modes' maximum (the client's default)
    temperatures: tuple[float, ...]
    rtts_ms: tuple[float, ...]
    lte: bool
    prompts: tuple[dict, ...]
    max_new_tokens: int
    # Sampled (T > 0) generations per prompt and config, seeds crc32(prompt id) + 0, 1, ...: one
    # sampled path of 32 tokens is luck more than speed (greedy output needs only one).
    samples: int = 1
    # Greedy generations per prompt and config: the same output, timed again (one 32-token run
    # on this shared machine carries 10-20% timing noise).
    repeats: int = 1
    modes: tuple[str, ...] | None = None  # None: every mode (MODES)

    def samples_of(self, cfg: Config) -> int:
        return self.samples if cfg.temperature > 0 else self.repeats

    def schedule(self) -> list[tuple[Config, int]]:
        """(config, sample) in run order: per condition and temperature, sample 0 of every mode,
        then sample 1 of every mode, and so on. A slow spell of the machine then falls on all
        the modes being compared, not on the three runs of one of them."""
        groups: dict[tuple, list[Config]] = {}
        for c in self.configs():
            groups.setdefault((c.rtt_ms, c.link, c.temperature), []).append(c)
        return [
            (c, j)
            for configs in groups.values()
            for j in range(max(self.samples_of(c) for c in configs))
            for c in configs
            if j < self.samples_of(c)
        ]

    @property
    def planned(self) -> int:
        return sum(self.samples_of(c) for c in self.configs()) * len(self.prompts)

    def only(self, conditions: Sequence[float | str]) -> BenchPlan:
        """This plan cut to some conditions (round trips in ms, ``lte``), for rerunning cells."""
        unknown = [c for c in conditions if c != "lte" and c not in self.rtts_ms]
        if unknown or ("lte" in conditions and not self.lte):
            raise SystemExit(f"--rtt {unknown or 'lte'}: not in this plan's conditions")
        rtts = tuple(r for r in self.rtts_ms if r in conditions)
        return replace(self, rtts_ms=rtts, lte="lte" in conditions)

    def modes_only(self, modes: Sequence[str]) -> BenchPlan:
        """This plan cut to some modes (``--mode``): those rows of every cell, nothing else."""
        unknown = [m for m in modes if m not in MODES]
        if unknown:
            raise SystemExit(f"--mode {unknown}: not one of {MODES}")
        return replace(self, modes=tuple(modes))

    def at(self, temperatures: Sequence[float]) -> BenchPlan:
        """This plan cut to some temperatures (``--temperature``): one short cell to check."""
        unknown = [t for t in temperatures if t not in self.temperatures]
        if unknown:
            raise SystemExit(f"--temperature {unknown}: not in this plan's temperatures")
        return replace(self, temperatures=tuple(t for t in self.temperatures if t in temperatures))

    def configs(self) -> list[Config]:
        """Condition-major, so a run stopped early still covers every temperature at the low
        RTTs; every mode runs in the same minutes as the others of its condition."""
        out = [Config("edge-only", 0, t, 0.0) for t in self.temperatures]  # no network: once
        conditions = [(rtt, "") for rtt in self.rtts_ms] + ([(LTE["rtt_ms"], "lte")] * self.lte)
        for rtt, link in conditions:
            for t in self.temperatures:
                out.append(Config("cloud-only", 0, t, rtt, link))
                out += [Config("lock-step", k, t, rtt, link) for k in self.ks]
                out.append(Config("lock-step-adaptive", self.k_max, t, rtt, link))
                out.append(Config("cloud-led", self.k_max, t, rtt, link))
                out.append(Config("auto", self.k_max, t, rtt, link))
                out.append(Config("auto-warm", self.k_max, t, rtt, link))
        return [c for c in out if self.modes is None or c.mode in self.modes]


def condition(text: str) -> float | str:
    """--rtt: a round trip in ms of the plan, or ``lte`` for the LTE-like link."""
    if text == "lte":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a round trip in ms nor 'lte': {text!r}") from None


def load_prompts() -> list[dict]:
    return [json.loads(line) for line in (HERE / "prompts.jsonl").read_text().splitlines()]


def make_plan(quick: bool, max_new_tokens: int | None) -> BenchPlan:
    """Full: 8 conditions x 2 temperatures x 8 modes x 2 prompts of 32 tokens, three seeds each
    at T = 0.7 and three runs each greedy, 105-130 min on the 2-core CPU box; quick: 3
    conditions x 2 temperatures x 6 modes x 1 prompt of 16, one seed."""
    prompts = load_prompts()
    code = [p for p in prompts if p["class"] == "code"]
    prose = [p for p in prompts if p["class"] == "prose"]
    if quick:
        return BenchPlan((4,), 8, (0.0, 0.7), (0.0, 200.0), True, (code[0],), max_new_tokens or 16)
    return BenchPlan(
        (2, 4, 8),
        8,
        (0.0, 0.7),
        (0.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0),
        True,
        (code[0], prose[0]),
        max_new_tokens or 32,
        samples=3,
        repeats=3,
    )


async def generate(
    address, drafter, prompt_ids, cfg: Config, max_new: int, seed: int, link: Link | None = None
):
    """One generation on a new client (given ``link``, the memory of an earlier one); returns
    it and the link its client measured."""
    split = cfg.mode in SPLIT_MODES
    gen_cfg = GenerationConfig(
        max_new_tokens=max_new,
        sampling=SamplingConfig(temperature=cfg.temperature),
        seed=seed,
        max_draft_tokens=max(cfg.k, 1),
        adaptive=cfg.mode != "lock-step",
        # auto(-warm) and cloud-led: as with no seed (adaptive); the seed keeps runs comparable
        session_mode=SESSION_MODE.get(cfg.mode, "lock-step"),
    )
    mode = "split" if split else cfg.mode
    address = None if cfg.mode == "edge-only" else address
    async with SplitClient(address, drafter, link=link) as client:
        gen = client.generate(prompt_ids, gen_cfg, route=mode)
        await gen.collect()
    return gen, client.link


def record(cfg: Config, prompt: dict, sample: int, gen) -> dict:
    s = gen.stats
    return {
        **s.summary(),  # the client's route ("split"), then the bench's config and mode
        **asdict(cfg),
        "key": cfg.key,
        "prompt_id": prompt["id"],
        "sample": sample,
        "class": prompt["class"],
        "token_ids": gen.token_ids,
        "draft_ms": s.draft_ms,
        "round_ms": s.round_ms,
        "verify_ms": s.verify_ms,
        "server_ms": s.server_ms,
        "queue_ms": s.queue_ms,
        "token_times_s": s.token_times_s,
        "k_chosen": s.k_chosen,
        "block_hint": s.max_draft_tokens_hint,
    }


def run_meta(
    plan: BenchPlan, target_dir, draft_dir, precision: str, dtype: str, edge_cores, cloud_cores
) -> dict:
    """What the report reads besides the raw records: the run's conditions and plan."""
    return {
        **stamp(),
        "target": str(target_dir),
        "draft": str(draft_dir),
        "draft_precision": precision,
        "target_dtype": dtype,
        "edge_cores": sorted(edge_cores),
        "cloud_cores": sorted(cloud_cores),
        "plan": asdict(plan) | {"prompts": len(plan.prompts)},
        "planned": plan.planned,
    }


async def run_all(
    plan: BenchPlan, address: str, drafter, codec, raw: Path, done: set, links_file: Path
) -> None:
    """Runs what ``done`` lacks of ``plan``, appending to ``raw``; ``links_file``: the link
    memory (edge.link_memory) auto runs save to and auto-warm runs read, per cell."""
    gateway_port = int(address.rsplit(":", 1)[1])
    encoded = {p["id"]: codec.chat_prompt(p["prompt"]) for p in plan.prompts}
    await generate(
        address, drafter, encoded[plan.prompts[0]["id"]], Config("lock-step", 4, 0, 0), 8, 0
    )
    todo = [
        (c, p, j)
        for c, j in plan.schedule()
        for p in plan.prompts
        if (c.key, p["id"], j) not in done
    ]
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress, raw.open("a") as out:
        task = progress.add_task("generations", total=len(todo))
        for cfg, prompt, j in todo:
            progress.update(task, description=f"{cfg.key:28s} {prompt['id']} #{j}")
            seed = zlib.crc32(prompt["id"].encode()) + j
            ids = encoded[prompt["id"]]
            link = LTE if cfg.link == "lte" else {"rtt_ms": cfg.rtt_ms}
            async with DelayProxy(gateway_port, **link) as proxy:
                # RTT 0 goes direct: no proxy hop in the loopback baseline
                via = f"127.0.0.1:{proxy.port}" if cfg.rtt_ms > 0 else address
                # The link each cell's latest auto (or auto-warm) run measured, per prompt,
                # named by the cell (each run has its own proxy port): auto-warm runs right
                # after auto in the schedule, on a new client given what the file holds.
                cell = f"{cfg.rtt_ms:g}/{cfg.link}/{cfg.temperature:g}/{prompt['id']}"
                known = load_link(cell, links_file) if cfg.mode == "auto-warm" else None
                gen, measured = await generate(
                    via, drafter, ids, cfg, plan.max_new_tokens, seed, known
                )
                if cfg.mode in ("auto", "auto-warm") and measured is not None:
                    save_link(cell, measured, links_file)
            out.write(json.dumps(record(cfg, prompt, j, gen)) + "\n")
            out.flush()
            progress.advance(task)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="make bench", description=__doc__)
    p.add_argument("--quick", action="store_true", help="small subset, a few minutes")
    p.add_argument("--resume", action="store_true", help="continue the raw file of a stopped run")
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument(
        "--repeats",
        type=int,
        metavar="N",
        help="generations per prompt and config (greedy runs and seeds alike): a shorter check",
    )
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    _add_precision_arg(p, "the draft's weights, as the edge ships them", prog="make bench")
    p.add_argument("--target-dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    p.add_argument("--out", type=Path, default=HERE.parent / "docs")
    p.add_argument("--skip-overhead", action="store_true")
    p.add_argument(
        "--rtt",
        action="append",
        type=condition,
        metavar="MS|lte",
        help="only this condition (repeatable): rerun some cells into their own report",
    )
    p.add_argument(
        "--temperature",
        action="append",
        type=float,
        metavar="T",
        help="only this temperature (repeatable): with --quick and --rtt, one short cell",
    )
    p.add_argument(
        "--mode",
        action="append",
        metavar="MODE",
        help=f"only this mode (repeatable; {', '.join(MODES)}): auto-warm needs auto before it",
    )
    args = p.parse_args(argv)
    interrupt_on_sigterm()

    from bench.overhead import measure_overhead
    from bench.report import write_report
    from specsplit.edge.export.ensure import ensure_draft_onnx
    from specsplit.edge.onnx_drafter import OnnxDrafter
    from specsplit.edge.text import TextCodec
    from specsplit.shared.weights.sources import resolve_model

    plan = make_plan(args.quick, args.max_new_tokens)
    if args.rtt:
        plan = plan.only(args.rtt)
    if args.temperature:
        plan = plan.at(args.temperature)
    if args.mode:
        plan = plan.modes_only(args.mode)
    if args.repeats:
        plan = replace(plan, repeats=args.repeats, samples=args.repeats)
    name = "benchmarks-quick" if args.quick else "benchmarks"
    if args.target_dtype != "auto":
        name += f"-{args.target_dtype}"
    if args.rtt:  # never over the full report
        name += "-rtt" + "-".join(str(c) if c == "lte" else f"{c:g}" for c in args.rtt)
    if args.temperature:
        name += "-t" + "-".join(f"{t:g}" for t in args.temperature)
    if args.mode:
        name += "-" + "-".join(args.mode)
    raw = args.out / f"{name}-raw.jsonl"
    meta_path = args.out / f"{name}-meta.json"
    args.out.mkdir(parents=True, exist_ok=True)
    done = set()
    if args.resume and raw.exists():
        records = map(json.loads, raw.read_text().splitlines())
        done = {(r["key"], r["prompt_id"], r.get("sample", 0)) for r in records}
    else:
        raw.write_text("")
    target_dir = resolve_model(args.target)
    draft_dir = ensure_draft_onnx(args.draft, PRECISION_TAGS[args.precision])
    edge_cores, cloud_cores = split_cores()
    os.sched_setaffinity(0, edge_cores)
    meta = run_meta(
        plan, target_dir, draft_dir, args.precision, args.target_dtype, edge_cores, cloud_cores
    )
    if done and meta_path.exists():  # a resumed run reports its first start and total time
        before = json.loads(meta_path.read_text())
        meta["date"] = before.get("date", meta["date"])
        meta["resumed_wall_s"] = before.get("wall_s", 0.0) + before.get("resumed_wall_s", 0.0)
    meta_path.write_text(json.dumps(meta, indent=1))  # a stopped run can still be reported
    t0 = time.monotonic()
    interrupted = False
    with tempfile.TemporaryDirectory(prefix="specsplit-bench-") as logs:
        cloud = pinned_cloud(target_dir, cloud_cores, Path(logs), "--dtype", args.target_dtype)
        with console.status("starting the cloud ..."):
            cloud.start()
        try:
            drafter = OnnxDrafter(draft_dir, threads=len(edge_cores))
            codec, links_file = TextCodec(draft_dir), Path(logs) / "links.json"
            asyncio.run(run_all(plan, cloud.address, drafter, codec, raw, done, links_file))
        except KeyboardInterrupt:
            interrupted = True  # keep what was measured; report it below
            console.print("[yellow]interrupted: reporting the generations finished so far")
        finally:
            cloud.stop()
    meta["wall_s"] = time.monotonic() - t0 + meta.pop("resumed_wall_s", 0.0)
    if not (args.skip_overhead or interrupted):
        meta["overhead"] = measure_overhead(edge_cores, cloud_cores)
    meta_path.write_text(json.dumps(meta, indent=1))
    report = write_report(raw, meta_path, args.out, name)
    console.print(f"report: {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
