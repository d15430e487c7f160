"""Turns a benchmark's raw JSONL into docs/<name>.md with tables and PNG plots.

Every figure is computed here from the raw records, so ``python -m bench.report`` regenerates the
report from the raw file alone.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from bench import peers_report
from bench.report_modes import (
    ADAPTIVE,
    SPLIT,
    after_rejection_table,
    bytes_table,
    condition,
    llama_cpp_tok_s,
    normalise,
    speed_plots,
    step_ms,
    targets,
    timing_noise,
    warm_table,
)
from bench.stamp import stamp_line

TARGETS = {"speedup": 1.5, "passes_per_token": 0.35, "overhead_ms": 3.0}


def aggregate(records: list[dict]) -> dict:
    """Figures of one group of generations (same config, possibly several prompts)."""
    new = sum(r["new_tokens"] for r in records)
    wall = sum(r["wall_s"] for r in records)
    itl = np.concatenate([np.diff(r["token_times_s"]) for r in records if r["token_times_s"]])
    drafted = sum(r["drafted"] for r in records)
    out = {
        "n": len(records),
        "tokens": new,
        "tok_s": new / wall if wall else 0.0,
        "ttft_ms": float(np.median([r["ttft_s"] for r in records])) * 1e3,
        "itl_p50_ms": float(np.percentile(itl, 50)) * 1e3 if itl.size else 0.0,
        "itl_p95_ms": float(np.percentile(itl, 95)) * 1e3 if itl.size else 0.0,
        "acceptance": sum(r["accepted"] for r in records) / drafted if drafted else None,
        "tokens_per_round": (new / sum(r["rounds"] for r in records))
        if records[0]["mode"] != "edge-only"
        else None,
        "passes_per_token": sum(r["target_forward_passes"] for r in records) / new,
        "up_b_per_token": sum(r["bytes_up"] for r in records) / new,
        "down_b_per_token": sum(r["bytes_down"] for r in records) / new,
    }
    out["ideal_tok_s"] = _ideal(records, out["tokens_per_round"])
    out["achieved_ideal"] = out["tok_s"] / out["ideal_tok_s"] if out["ideal_tok_s"] else None
    rounds = [(r, v) for x in records for r, v in zip(x["round_ms"], x["verify_ms"], strict=False)]
    out["overhead_p50_ms"] = (
        float(np.median([r - v for r, v in rounds]))
        if rounds and records[0]["rtt_ms"] == 0
        else None
    )
    return out


def _ideal(records: list[dict], tokens_per_round: float | None) -> float | None:
    """docs/design.md#performance without overheads: tokens per round / (k t_draft + RTT +
    t_verify(k)).

    Tokens per round is the measured one: the i.i.d. formula (1 - a^(k+1)) / (1 - a) with the
    measured per-token acceptance a underestimates it, because agreement comes in runs (code).
    So achieved/ideal isolates what overheads (serialisation, hops, queueing, prefill) cost.
    """
    r0 = records[0]
    verify = np.mean([v for r in records for v in r["verify_ms"]]) if r0["verify_ms"] else None
    if r0["mode"] == "cloud-only":
        return 1e3 / verify if verify else None
    if r0["mode"] not in ("split", "lock-step", "lock-step-adaptive") or verify is None:
        return None  # cloud-led overlaps drafting, network and verification: no simple formula
    draft = np.mean([d for r in records for d in r["draft_ms"]])
    return tokens_per_round / ((draft + r0["rtt_ms"] + verify) / 1e3)


def group(records: list[dict], *fields: str) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        out[tuple(r[f] for f in fields)].append(r)
    return out


def _fmt(v, spec=".2f") -> str:
    return "–" if v is None else format(v, spec)


def config_table(records: list[dict], temperature: float, cls: str | None) -> list[str]:
    rows = [
        r for r in records if r["temperature"] == temperature and (cls is None or r["class"] == cls)
    ]
    base = {
        key: aggregate(g)["tok_s"]
        for key, g in group(
            [r for r in rows if r["mode"] == "cloud-only"], "rtt_ms", "link"
        ).items()
    }
    edge_only = [r for r in rows if r["mode"] == "edge-only"]
    step = step_ms(records, temperature)
    lines = [
        "| mode | k | RTT | RTT ÷ step | tok/s | × cloud-only | TTFT ms | ITL p50 / p95 ms |"
        " acceptance | tokens/round | target passes/token | bytes up / down per token |"
        " ideal tok/s | achieved/ideal |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = ("cloud-only", *SPLIT)
    for (mode, k, rtt, link), g in sorted(
        group(rows, "mode", "k", "rtt_ms", "link").items(),
        key=lambda x: (x[0][3], x[0][2], order.index(x[0][0]) if x[0][0] in order else 9, x[0][1]),
    ):
        if mode == "edge-only":
            continue
        a = aggregate(g)
        ratio = f"{rtt / step:.2f}" if step else "–"
        lines.append(_row(mode, k, condition(rtt, link), ratio, a, base.get((rtt, link))))
    if edge_only:
        lines.append(_row("edge-only", 0, "n/a", "–", aggregate(edge_only), base.get((0.0, ""))))
    return lines


def _runs(n: int) -> str:
    return "one run" if n == 1 else f"{n} runs, the same output timed again"


def _row(mode, k, cond, ratio, a, base) -> str:
    k_text = "≤ " + str(k) if mode in ADAPTIVE else (k or "–")
    return (
        f"| {mode} | {k_text} | {cond} | {ratio} "
        f"| {a['tok_s']:.2f} | {_fmt(a['tok_s'] / base if base else None)} "
        f"| {a['ttft_ms']:.0f} | {a['itl_p50_ms']:.0f} / {a['itl_p95_ms']:.0f} "
        f"| {_fmt(a['acceptance'])} | {_fmt(a['tokens_per_round'])} "
        f"| {a['passes_per_token']:.2f} "
        f"| {a['up_b_per_token']:.0f} / {a['down_b_per_token']:.0f} "
        f"| {_fmt(a['ideal_tok_s'])} | {_fmt(a['achieved_ideal'])} |"
    )


def identical_to_target(records: list[dict]) -> tuple[int, int]:
    """Greedy split outputs equal to cloud-only's for the same prompt and RTT: (equal, total)."""
    records = [normalise(dict(r)) for r in records]
    ref = {
        (r["prompt_id"], r["rtt_ms"], r["link"]): r["token_ids"]
        for r in records
        if r["mode"] == "cloud-only" and r["temperature"] == 0
    }
    pairs = [
        (r["token_ids"], ref.get((r["prompt_id"], r["rtt_ms"], r["link"])))
        for r in records
        if r["mode"] in SPLIT and r["temperature"] == 0
    ]
    return sum(a == b for a, b in pairs if b is not None), sum(b is not None for _, b in pairs)


def plots(records: list[dict], out: Path, name: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = speed_plots(records, out, name)
    fig, ax = plt.subplots(figsize=(6, 4))
    split = [r for r in records if r["mode"] in SPLIT]
    labels, values = [], []
    for (cls, t), g in sorted(group(split, "class", "temperature").items()):
        labels.append(f"{cls}\nT={t:g}")
        values.append(aggregate(g)["acceptance"] or 0.0)  # None: nothing was verified
    ax.bar(labels, values, color="tab:blue")
    ax.set(ylim=(0, 1), ylabel="acceptance rate", title="acceptance per prompt class (all k, RTT)")
    files.append(f"img/{name}-acceptance.png")
    fig.savefig(out / files[-1], dpi=110, bbox_inches="tight")
    plt.close(fig)
    return files


def _headline(records: list[dict]) -> tuple[list[str], dict]:
    rows = [
        r
        for r in records
        if r["temperature"] == 0
        and r["rtt_ms"] == 0
        and r["class"] == "code"
        and r["mode"] != "edge-only"
        and not r["link"]
    ]
    if not any(r["mode"] == "cloud-only" for r in rows):  # e.g. make bench --rtt 100
        return ["(No greedy code generations at RTT 0 in this run: no headline.)"], {}
    base = aggregate([r for r in rows if r["mode"] == "cloud-only"])
    best = {}
    lines = [
        "| mode | k | tok/s | × cloud-only | target passes/token | acceptance |"
        " overhead p50 ms/round |",
        "|---|---|---|---|---|---|---|",
    ]
    for (mode, k), g in sorted(group(rows, "mode", "k").items(), key=lambda x: x[0][1]):
        a = aggregate(g)
        speedup = a["tok_s"] / base["tok_s"]
        if mode in SPLIT and speedup > best.get("speedup", 0):
            best = {"k": k, "speedup": speedup, **a}
        lines.append(
            f"| {mode} | {k or '–'} | {a['tok_s']:.2f} | {speedup:.2f} "
            f"| {a['passes_per_token']:.2f} | {_fmt(a['acceptance'])} "
            f"| {_fmt(a['overhead_p50_ms'], '.1f') if mode in SPLIT else '–'} |"
        )
    return lines, best


def _targets(best: dict, overhead: dict | None) -> list[str]:
    ov = overhead["ms"]["overhead = round - verify"]["p50"] if overhead else None
    checks = [
        ("split ≥ 1.5× cloud-only tokens/s", best.get("speedup"), TARGETS["speedup"], ">="),
        (
            "target passes per generated token ≤ 0.35",
            best.get("passes_per_token"),
            TARGETS["passes_per_token"],
            "<=",
        ),
        ("overhead ≤ 3 ms per round at p50 (micro-benchmark)", ov, TARGETS["overhead_ms"], "<="),
    ]
    lines = []
    for label, value, target, op in checks:
        met = value is not None and (value >= target if op == ">=" else value <= target)
        lines.append(
            f"- {'met' if met else 'MISSED'}: {label} — measured {_fmt(value)}"
            + (f" (best k = {best['k']})" if best and "cloud" in label else "")
        )
    return lines


def _llama_note(llama: dict[str, float], cls: str) -> list[str]:
    """Where the × llama.cpp column's figure comes from (bench.report_modes.llama_cpp_tok_s)."""
    if cls not in llama:
        return [
            "× llama.cpp: no figure (no docs/peers-raw.jsonl with llama.cpp on the cloud's core"
            f" for {cls} prompts: `make bench-peers` writes it).",
            "",
        ]
    return [
        f"× llama.cpp: the default's tok/s over llama.cpp at its defaults on the cloud's one"
        f" core, {llama[cls]:.2f} tok/s on {cls} prompts (`{peers_report.BASELINE}` in"
        " `peers-raw.jsonl`, from `make bench-peers`: the held-out prompts, 64 new tokens, at"
        " RTT 0, in other minutes than this page's). Client cold: a new client with no link in"
        " memory, as a fresh `specsplit-edge generate` process; warm: the link its cell's cold"
        " run measured, saved to and read back from a link-memory file (edge/link_memory.py).",
        "",
    ]


def write_report(raw: Path, meta_path: Path, out: Path, name: str) -> Path:
    lines = raw.read_text().splitlines()
    records = [normalise(json.loads(line)) for line in lines if line.strip()]
    meta = json.loads(meta_path.read_text())
    (out / "img").mkdir(parents=True, exist_ok=True)
    images = plots(records, out, name)
    headline, best = _headline(records)
    same, total = identical_to_target(records)
    plan = meta["plan"]
    noise, warm = timing_noise(records), warm_table(records)
    corrections = after_rejection_table(records)
    peers_raw = raw.parent / "peers-raw.jsonl"  # make bench-peers writes it beside this page
    llama = llama_cpp_tok_s(peers_raw)
    md = [
        f"# specsplit benchmarks{' (quick subset)' if 'quick' in name else ''}",
        "",
        stamp_line(meta),
        "",
        f"Generated by `make {'bench-quick' if 'quick' in name else 'bench'}`"
        f" in {meta.get('wall_s', 0) / 60:.0f} min. Raw records: `{raw.name}`; regenerate this"
        f" page from them with `python -m bench.report docs/{raw.name}`.",
        "",
        f"Completeness: {len(records)} of {meta.get('planned', len(records))} planned generations"
        + (
            " (a stopped run: tables hold the configurations it reached)."
            if len(records) < meta.get("planned", len(records))
            else "."
        ),
        "",
        "## Conditions",
        "",
        f"- Machine: {meta.get('cpu', 'unknown')}, {os.cpu_count()} cores, {platform.system()} "
        f"{platform.machine()}, Python {sys.version.split()[0]}, no GPU.",
        f"- Target: `{Path(meta['target']).name}` in Triton (Python backend, torch, dtype "
        f"{meta['target_dtype']}; auto = the weights calibrated at load), "
        f"pinned to cores {meta['cloud_cores']}"
        f" with {len(meta['cloud_cores'])} thread(s) in every mode.",
        f"- Draft: `{Path(meta['draft']).name}` in ONNX Runtime (CPU EP, "
        f"{meta['draft_precision']}), pinned to cores {meta['edge_cores']} "
        f"with {len(meta['edge_cores'])} thread(s).",
        f"- {plan['prompts']} prompts (`bench/prompts.jsonl`, chat template), "
        f"{plan['max_new_tokens']} new tokens each"
        + (
            f", {plan['samples']} seeds per prompt at temperature > 0"
            f" (greedy: {_runs(plan.get('repeats', 1))})"
            if plan.get("samples", 1) > 1
            else ""
        )
        + f"; fixed k ∈ {list(plan['ks'])} (lock-step),"
        f" adaptive k ≤ {plan.get('k_max', '–')} ({', '.join(ADAPTIVE)}),"
        f" temperature ∈ {list(plan['temperatures'])}, RTT ∈ {list(plan['rtts_ms'])} ms"
        + (", and the LTE-like link." if plan.get("lte") else "."),
        "- RTT is emulated by an asyncio TCP proxy between edge and gateway that holds each chunk"
        " RTT/2 in each direction (bench/proxy.py); the LTE-like link adds ± 10 ms jitter (bytes"
        " kept in order), 5 Mbit/s up and 20 Mbit/s down. RTT 0 is a direct loopback"
        " connection. RTT ÷ step divides RTT by the target's median forward pass here, so the"
        " CPU rows map onto a GPU cloud with the same ratio (a 20 ms step at 50 ms RTT is 2.5).",
        "- Modes: cloud-only (the target alone, streamed); lock-step with a fixed k; lock-step with"
        " adaptive k (edge/adaptive.py); cloud-led with adaptive speculation (the cloud never waits"
        " for drafts, docs/design.md#cloud-led); auto, the default: cloud-led from Start where"
        " nothing is measured on the link (edge/session_plan.py), else lock-step with"
        " adaptive k that hands over to cloud-led once its measurements say that is faster"
        " (edge/mode_switch.py);"
        " auto-warm, auto on a new client given the link its cell's auto run just measured"
        " (`SplitClient(link=...)`, an app's second generation on). Every run is on a new client"
        " and channel. The bench gives every run a seed so that the modes sample the same paths;"
        " auto, auto-warm and cloud-led run as they do without one (adaptive).",
        "- tok/s = generated tokens / wall time seen at the edge, over all prompts of a row;"
        " ITL = time between successive tokens reaching the client (tokens committed together"
        " count 0); bytes are protobuf payload sizes (no HTTP/2 framing); ideal tok/s follows"
        " docs/design.md#performance from the measured acceptance, draft time, verify time and"
        " RTT.",
        "",
        "## Headline: RTT 0, greedy, code prompts",
        "",
        *headline,
        "",
        f"Greedy split output identical to the target's own (cloud-only) output: {same}/{total}"
        " generations.",
        "",
        "### Targets",
        "",
        *_targets(best, meta.get("overhead")),
        "",
        *(
            line
            for cls in ("code", "prose")
            if any(r["class"] == cls for r in records)
            for line in (
                f"## Default mode against cloud-only and the best fixed k, {cls} prompts",
                "",
                *_llama_note(llama, cls),
                *targets(records, cls, llama),
                "",
            )
        ),
        *noise,
        *([""] if noise else []),
        *warm,
        *([""] if warm else []),
        *corrections,
        *([""] if corrections else []),
        "## Bytes per generated token, by mode (protobuf payload, all conditions and prompts)",
        "",
        *bytes_table(records),
        "",
    ]
    for t in sorted({r["temperature"] for r in records}):
        for cls in ("code", "prose"):
            md += [f"## Temperature {t:g}, {cls} prompts", "", *config_table(records, t, cls), ""]
    if "overhead" in meta:
        ov = meta["overhead"]
        md += [
            "## Per-round overhead on loopback",
            "",
            f"{ov['model']}, {ov['rounds']} rounds.",
            "",
            "| part | p50 ms | p99 ms |",
            "|---|---|---|",
        ]
        md += [f"| {k} | {v['p50']:.2f} | {v['p99']:.2f} |" for k, v in ov["ms"].items()]
        md.append("")
    md += ["## Plots", ""] + [f"![{Path(i).stem}]({i})" for i in images] + [""]
    path = out / f"{name}.md"
    path.write_text("\n".join(md))
    return path


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__)
    p.add_argument(
        "raw",
        nargs="?",
        type=Path,
        default=Path("docs/benchmarks-raw.jsonl"),
        help="a run's raw records (NAME-raw.jsonl, its NAME-meta.json beside it); the page "
        "NAME.md is written beside them",
    )
    raw_path = p.parse_args(argv).raw
    stem = raw_path.name.removesuffix("-raw.jsonl")
    meta = raw_path.with_name(f"{stem}-meta.json")
    for needed in (raw_path, meta):
        if not needed.is_file():
            p.error(f"{needed}: no such file (make bench writes it)")
    print(write_report(raw_path, meta, raw_path.parent, stem))
    return 0


if __name__ == "__main__":
    sys.exit(main())
