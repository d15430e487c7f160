"""The session-mode parts of the benchmark report: targets per condition, bytes per token per
mode, and tok/s against RTT per mode. Helpers of ``bench.report`` (which owns the page)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from bench import peers_report
from specsplit.edge.mode_switch import LEAD_AT_START

SPLIT = ("lock-step", "lock-step-adaptive", "cloud-led", "auto", "auto-warm")
ADAPTIVE = ("lock-step-adaptive", "cloud-led", "auto", "auto-warm")  # k is their maximum
# What GenerationConfig() runs: session mode auto (lock-step with adaptive k until it measures
# cloud-led to be faster). Runs before auto had its own rows ran cloud-led by default.
DEFAULT_MODE = "auto"
EARLIER_DEFAULT = "cloud-led"
TARGET_VS_CLOUD = 1.0
TARGET_VS_BEST_K = 0.97
TARGET_RTT0_GREEDY_CODE = 2.3
# The clients the default mode is reported for, each its own row: a cold client has no link in
# memory (a fresh `specsplit-edge generate` process), a warm one has the link its cell's cold
# run measured, read back from a link-memory file (edge.link_memory), as the CLI's next process.
CLIENTS = (("cold", DEFAULT_MODE), ("warm", "auto-warm"))


def llama_cpp_tok_s(peers_raw: Path) -> dict[str, float]:
    """llama.cpp at its defaults on the cloud's one core (bench.peers_report.BASELINE), tok/s
    per prompt class ("code", "prose"), from a ``make bench-peers`` raw file; {} without one."""
    if not peers_raw.exists():
        return {}
    rows = [json.loads(line) for line in peers_raw.read_text().splitlines() if line.strip()]
    base = [r for r in rows if r.get("row") == peers_report.BASELINE]
    by_class = {cls: [r for r in base if r["class"] == cls] for cls in {r["class"] for r in base}}
    return {cls: peers_report.tok_s(g) for cls, g in by_class.items() if g}


def normalise(r: dict) -> dict:
    """The bench's mode names. Records of runs before session modes: "split" was lock-step
    with a fixed k; early session-mode records carry the edge's "split" but their key says."""
    if "key" in r and r["mode"] == "split":
        r["mode"] = r["key"].split("/", 1)[0]
    if r["mode"] == "split":
        r["mode"] = "lock-step"
    r.setdefault("link", "")
    return r


def condition(rtt: float, link: str) -> str:
    return "LTE (50 ± 10 ms, 5 / 20 Mbit/s)" if link == "lte" else f"{rtt:g} ms"


def step_ms(records: list[dict], temperature: float) -> float | None:
    """The target's step: median forward pass of cloud-only at this temperature."""
    v = [x for r in records for x in r["verify_ms"] if r["mode"] == "cloud-only"]
    v = v or [x for r in records for x in r["verify_ms"]]
    return float(np.median(v)) if v else None


def cells(records: Iterable[dict]) -> list[tuple[tuple, dict[str, list[dict]]]]:
    """The records of each cell, (link, RTT, temperature) in that order, by mode."""
    out: dict[tuple, dict[str, list[dict]]] = {}
    for r in records:
        cell = out.setdefault((r["link"], r["rtt_ms"], r["temperature"]), {})
        cell.setdefault(r["mode"], []).append(r)
    return sorted(out.items(), key=lambda kv: kv[0])


def _tok_s(records: list[dict]) -> float:
    wall = sum(r["wall_s"] for r in records)
    return sum(r["new_tokens"] for r in records) / wall if wall else 0.0


def targets(
    records: list[dict], cls: str | None = None, llama: dict[str, float] | None = None
) -> list[str]:
    """Per condition and temperature: the default mode against cloud-only and the best fixed k,
    a row per client (CLIENTS: cold, warm) where the run has it; and against llama.cpp on the
    cloud's core where ``llama`` (llama_cpp_tok_s) holds a figure for ``cls``."""
    modes = {r["mode"] for r in records}
    clients = CLIENTS if DEFAULT_MODE in modes else (("–", EARLIER_DEFAULT),)
    llama_tok_s = (llama or {}).get(cls) if cls else None
    lines = [
        f"Default = {clients[0][1]} (no k given). Targets: ≥ {TARGET_VS_CLOUD:g}× cloud-only and"
        f" ≥ {TARGET_VS_BEST_K:g}× the best fixed k at every condition, cold and warm clients; ≥"
        f" {TARGET_RTT0_GREEDY_CODE:g}× cloud-only at RTT 0, greedy, code.",
        "",
        "| condition | T | client | RTT ÷ step | default tok/s | cloud-only | × llama.cpp |"
        " best fixed k (tok/s) | × cloud-only | × best k | × best k per run | met |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (link, rtt, t), modes in cells(r for r in records if cls is None or r["class"] == cls):
        for client, mode in clients:
            row = _target_row(records, link, rtt, t, modes, client, mode, cls, llama_tok_s)
            lines += [row] if row else []
    return lines


def _target_row(records, link, rtt, t, modes, client, mode, cls, llama_tok_s) -> str | None:
    """One row of ``targets``: ``mode``'s records in the cell ``modes``, as ``client``."""
    default, cloud = modes.get(mode, []), modes.get("cloud-only", [])
    if not (default and cloud):
        return None
    fixed: dict[int, list[dict]] = {}
    for r in modes.get("lock-step", []):
        fixed.setdefault(r["k"], []).append(r)
    d, c = _tok_s(default), _tok_s(cloud)
    best_k, best = max(
        ((k, _tok_s(g)) for k, g in fixed.items()), key=lambda x: x[1], default=(None, None)
    )
    vs_best = d / best if best else None
    headline = rtt == 0 and not link and t == 0 and cls in ("code", None)  # code's own bar
    need = TARGET_RTT0_GREEDY_CODE if headline else TARGET_VS_CLOUD
    met = d / c >= need and (vs_best is None or vs_best >= TARGET_VS_BEST_K)
    step = step_ms(records, t)
    vs_llama = f"{d / llama_tok_s:.2f}" if llama_tok_s else "–"
    head = f"| {condition(rtt, link)} | {t:g} | {client} "
    if not step:
        return (
            f"{head}| – | {d:.2f} | {c:.2f} | {vs_llama} | – | {d / c:.2f} "
            f"| – | – | {'met' if met else 'MISSED'} |"
        )
    per_run = _per_run(default, fixed.get(best_k, []))
    return (
        f"{head}| {rtt / step:.2f} | {d:.2f} | {c:.2f} | {vs_llama} "
        f"| {'–' if best is None else f'k={best_k} ({best:.2f})'} | {d / c:.2f} "
        f"| {'–' if vs_best is None else f'{vs_best:.2f}'} | {per_run} "
        f"| {'met' if met else 'MISSED'} |"
    )


def _per_run(default: list[dict], best: list[dict]) -> str:
    """The default against the best fixed k, run by run (sample j of each, side by side in the
    schedule): the spread says how much of a gap is the machine's timing noise."""
    ratios = []
    for j in sorted({r.get("sample", 0) for r in default}):
        d = _tok_s([r for r in default if r.get("sample", 0) == j])
        b = _tok_s([r for r in best if r.get("sample", 0) == j])
        if b:
            ratios.append(d / b)
    if not ratios:
        return "–"
    lo, hi = min(ratios), max(ratios)
    return f"{lo:.2f}" if len(ratios) == 1 else f"{lo:.2f}–{hi:.2f}"


def timing_noise(records: list[dict]) -> list[str]:
    """Two runs of one configuration side by side: in a greedy cell where auto never led, auto
    ran exactly what lock-step adaptive runs (same code path, same decision rule, greedy output),
    so their tok/s ratio is the machine's run-to-run noise at the scale of one cell."""
    cells: dict[tuple, dict[str, list[dict]]] = {}
    for r in records:
        if r["temperature"] == 0 and r["mode"] in ("auto", "lock-step-adaptive"):
            key = (r["class"], r["link"], r["rtt_ms"])
            cells.setdefault(key, {}).setdefault(r["mode"], []).append(r)
    ratios = [
        _tok_s(m["auto"]) / _tok_s(m["lock-step-adaptive"])
        for m in cells.values()
        if m.get("auto") and m.get("lock-step-adaptive")
        if not any(r.get("lead_round") or r.get("led_at_start") for r in m["auto"])
    ]
    if not ratios:
        return []
    off = sum(abs(1 - x) >= 1 - TARGET_VS_BEST_K for x in ratios)
    return [
        f"Timing noise: in {len(ratios)} greedy cells auto never led, so it ran the same"
        " configuration as lock-step adaptive; their tok/s ratio there ranged"
        f" {min(ratios):.2f}–{max(ratios):.2f} (median {float(np.median(ratios)):.2f}), and was"
        f" {1 - TARGET_VS_BEST_K:.2f} or more away from 1 in {off} of them. Near the"
        f" {TARGET_VS_BEST_K:g} bar, a cell's met or MISSED above can flip from run to run.",
    ]


def warm_table(records: list[dict]) -> list[str]:
    """auto on a new client per generation (the default row) against auto-warm, a new client
    given the link the cell's auto run just measured (SplitClient(link=...)): what the memory
    saves an app from its second generation on. Both fresh channels, so only the memory differs."""
    rows = [r for r in records if r["mode"] in ("auto", "auto-warm")]
    if not any(r["mode"] == "auto-warm" for r in rows):
        return []
    lines = [
        "## Remembered link: auto against auto-warm (all prompts)",
        "",
        "auto-warm is auto on a new client given the link its cell's auto run had just measured"
        " (`SplitClient(link=...)`); both open a fresh channel, so only the memory differs. Where"
        f" the remembered round trip is {LEAD_AT_START:g} target steps, auto-warm starts cloud-led"
        " (`Start.session_mode` CLOUD_LED) instead of leading with its first Draft a round trip"
        " later.",
        "",
        "| condition | T | auto tok/s | auto-warm tok/s | × auto | TTFT p50 ms auto / warm |"
        " started cloud-led |",
        "|---|---|---|---|---|---|---|",
    ]
    for (link, rtt, t), modes in cells(rows):
        auto, warm = modes.get("auto", []), modes.get("auto-warm", [])
        if not (auto and warm):
            continue
        a, w = _tok_s(auto), _tok_s(warm)
        ttft = [float(np.median([r["ttft_s"] for r in g])) * 1e3 for g in (auto, warm)]
        led = sum(bool(r.get("led_at_start")) for r in warm)
        lines.append(
            f"| {condition(rtt, link)} | {t:g} | {a:.2f} | {w:.2f} | {w / a:.2f} "
            f"| {ttft[0]:.0f} / {ttft[1]:.0f} | {led}/{len(warm)} |"
        )
    return lines


def after_rejection_table(records: list[dict]) -> list[str]:
    """Per split mode and condition: target passes right after a pass that corrected a draft,
    how many of them verified no draft (GenerationStats.draftless_after_rejection): the steps a
    cloud-led target spends before the edge's drafts after the correction reach it, and of
    those the ones before whose Verdict the edge had sent none (GenerationStats.
    draftless_none_sent: it had nothing consistent to send); and the corrections a branch had
    been sent for (GenerationStats.corrections_branched, of corrections) and the passes after a
    correction that verified one (branch_passes)."""
    rows = [r for r in records if r.get("passes_after_rejection")]
    if not rows:
        return []
    lines = [
        "## Passes right after a correction (cloud-led steps; auto once it led)",
        "",
        "A draftless pass verifies nothing: the edge's drafts after the correction had not"
        " reached the cloud yet. The cloud waits for them where they are measured due sooner"
        " than waiting pays, at most one step (cloud/gateway/cloud_led.py). *none sent*: the"
        " edge had sent no Draft after the correction when the pass's Verdict came; the other"
        " draftless passes stepped without a Draft that was on its way. *branched*: corrections"
        " whose token a branch Draft had carried before the correcting Verdict came (greedy"
        " edges branch where the draft is unsure, edge/cloud_led.py); *verified a branch*: passes"
        " after a correction that verified one.",
        "",
        "| condition | T | mode | passes after a correction | draftless | none sent | share"
        " | branched | verified a branch |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (link, rtt, t), modes in cells(rows):
        for mode in SPLIT:
            group = modes.get(mode, [])
            passes = sum(r["passes_after_rejection"] for r in group)
            if not passes:
                continue
            draftless = sum(r.get("draftless_after_rejection", 0) for r in group)
            none_sent = sum(r.get("draftless_none_sent", 0) for r in group)
            corrections = sum(r.get("corrections", 0) for r in group)
            branched = sum(r.get("corrections_branched", 0) for r in group)
            verified = sum(r.get("branch_passes", 0) for r in group)
            lines.append(
                f"| {condition(rtt, link)} | {t:g} | {mode} | {passes} | {draftless} "
                f"| {none_sent} | {draftless / passes:.2f} | {branched}/{corrections} "
                f"| {verified} |"
            )
    return lines


def bytes_table(records: list[dict]) -> list[str]:
    lines = [
        "| mode | T | bytes up / token | bytes down / token | acceptance |",
        "|---|---|---|---|---|",
    ]
    order = ("cloud-only", *SPLIT)
    keys = sorted(
        {(r["mode"], r["temperature"]) for r in records if r["mode"] in order},
        key=lambda x: (x[1], order.index(x[0])),
    )
    for mode, t in keys:
        g = [r for r in records if (r["mode"], r["temperature"]) == (mode, t)]
        new = sum(r["new_tokens"] for r in g)
        drafted = sum(r["drafted"] for r in g)
        acc = f"{sum(r['accepted'] for r in g) / drafted:.2f}" if drafted else "–"
        up, down = sum(r["bytes_up"] for r in g) / new, sum(r["bytes_down"] for r in g) / new
        lines.append(f"| {mode} | {t:g} | {up:.0f} | {down:.0f} | {acc} |")
    return lines


def speed_plots(records: list[dict], out: Path, name: str) -> list[str]:
    """tok/s against RTT, one line per mode (and fixed k), per temperature; LTE left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    for t in sorted({r["temperature"] for r in records}):
        rows = [r for r in records if r["temperature"] == t and not r["link"]]
        fig, ax = plt.subplots(figsize=(6.5, 4))
        labels = sorted(
            {(r["mode"], r["k"]) for r in rows if r["mode"] != "edge-only"},
            key=lambda x: (x[0] != "cloud-only", x[0], x[1]),
        )
        for mode, k in labels:
            g = [r for r in rows if (r["mode"], r["k"]) == (mode, k)]
            pts = sorted(
                (rtt, _tok_s([r for r in g if r["rtt_ms"] == rtt]))
                for rtt in {r["rtt_ms"] for r in g}
            )
            label = f"lock-step k={k}" if mode == "lock-step" else mode
            style = {"c": "black", "lw": 2} if mode == "cloud-only" else {}
            ax.plot(*zip(*pts, strict=True), marker="o", label=label, **style)
        ax.set_xscale("symlog", linthresh=20)
        ax.set_ylim(bottom=0)
        ax.set(xlabel="emulated RTT (ms)", ylabel="tokens/s", title=f"tok/s vs RTT, T={t:g}")
        ax.legend(fontsize=8)
        files.append(f"img/{name}-tok-s-vs-rtt-t{t:g}.png")
        fig.savefig(out / files[-1], dpi=110, bbox_inches="tight")
        plt.close(fig)
    return files
