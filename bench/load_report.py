"""docs/load.md and docs/load.png from the raw generations of `make bench-load`.

Definitions (per N, mode and temperature):
- aggregate tokens/s: tokens committed to any session inside the steady window (it starts once
  every session has its first token), divided by its length;
- TTFT: request sent to first token, per generation; ITL: a generation's mean time per output
  token after the first ((t_last - t_first) / (n - 1)), per generation; p50 and p95 of each;
- passes/token: target verification passes per generated token; every Verdict reports how many
  sessions shared its pass, so a pass counts 1/sessions for each of its rounds;
- rows/pass and sessions/pass: means over passes; hint: the mean block size the cloud hinted
  (split; "–" where the edges do not read it: a seeded sampled run keeps its block sizes so that
  it repeats exactly), k: the mean block size the edges actually sent.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from bench.stamp import stamp_line

TARGETS = (
    "split N=4 >= 2.5x split N=1",
    "split >= 1.8x cloud-only for N <= 4",
    "split >= 1.0x cloud-only at every N",
    "cloud-only N=16 >= 4x cloud-only N=1",
)


def summarize(rows: list[dict], plan: dict) -> dict:
    win = plan["window_s"]
    tokens = sum(0 <= t <= win for r in rows for t in r["token_times_s"])
    ttft = [r["ttft_s"] for r in rows if r["ttft_s"] is not None]
    itl = [
        (r["token_times_s"][-1] - r["token_times_s"][0]) / (len(r["token_times_s"]) - 1)
        for r in rows
        if len(r["token_times_s"]) > 1
    ]
    inv = [1 / b for r in rows for b in r["batch_sessions"] if b > 0]
    rows_w = [
        rw / b
        for r in rows
        for b, rw in zip(r["batch_sessions"], r["batch_rows"], strict=True)
        if b > 0
    ]
    generated = sum(r["new_tokens"] for r in rows)
    passes = sum(inv)
    rounds = sum(r["rounds"] for r in rows)
    hints = [h for r in rows for h in r["block_hint"]]

    def pct(xs, q):
        return float(np.percentile(xs, q)) if xs else float("nan")

    return {
        "tok_s": tokens / win,
        "ttft_p50": pct(ttft, 50),
        "ttft_p95": pct(ttft, 95),
        "itl_p50": pct(itl, 50) * 1e3,
        "itl_p95": pct(itl, 95) * 1e3,
        "passes_per_token": passes / generated if generated else float("nan"),
        "rows_per_pass": sum(rows_w) / passes if passes else float("nan"),
        "sessions_per_pass": len(inv) / passes if passes else float("nan"),
        "hint": float(np.mean(hints)) if hints else float("nan"),
        "k": sum(r["drafted"] for r in rows) / rounds if rounds else 0.0,
        "generations": len(rows),
    }


def targets(s: dict) -> list[tuple[str, str, bool]]:
    """(target, figures, met) for the greedy table."""
    split = {n: v["tok_s"] for (m, t, n), v in s.items() if m == "split" and t == 0.0}
    cloud = {n: v["tok_s"] for (m, t, n), v in s.items() if m == "cloud-only" and t == 0.0}
    ns = sorted(set(split) & set(cloud))
    out = []
    if 1 in split and 4 in split:
        r = split[4] / split[1]
        out.append((TARGETS[0], f"{r:.2f}x", r >= 2.5))
    low = [n for n in ns if n <= 4]
    if low:
        rs = {n: split[n] / cloud[n] for n in low}
        figs = ", ".join(f"N={n}: {r:.2f}x" for n, r in rs.items())
        out.append((TARGETS[1], figs, min(rs.values()) >= 1.8))
    if ns:
        rs = {n: split[n] / cloud[n] for n in ns}
        figs = ", ".join(f"N={n}: {r:.2f}x" for n, r in rs.items())
        out.append((TARGETS[2], figs, min(rs.values()) >= 1.0))
    if 1 in cloud and 16 in cloud:
        r = cloud[16] / cloud[1]
        out.append((TARGETS[3], f"{r:.2f}x", r >= 4.0))
    return out


def plot(s: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = sorted({t for _, t, _ in s})
    fig, axes = plt.subplots(1, len(temps), figsize=(5.5 * len(temps), 4), squeeze=False)
    for ax, t in zip(axes[0], temps, strict=True):
        for mode, style in (("split", "o-"), ("cloud-only", "s--")):
            pts = sorted((n, v["tok_s"]) for (m, tt, n), v in s.items() if m == mode and tt == t)
            if pts:
                ax.plot(*zip(*pts, strict=True), style, label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent sessions N")
        ax.set_ylabel("aggregate tokens/s")
        ax.set_title(f"T = {t:g}")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fig(x: float) -> str:
    return "–" if math.isnan(x) else f"{x:.1f}"


def write_load_report(raw: Path, meta_path: Path, out: Path, name: str) -> Path:
    meta = json.loads(meta_path.read_text())
    rows = [json.loads(line) for line in raw.read_text().splitlines() if line]
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["mode"], r["temperature"], r["sessions"]), []).append(r)
    s = {key: summarize(g, meta["plan"]) for key, g in groups.items()}
    plot(s, out / f"{name}.png")
    plan = meta["plan"]
    lines = [
        f"# Load: one cloud, N concurrent sessions ({name})",
        "",
        stamp_line(meta),
        "",
        f"Generated by `make {'bench-load-quick' if 'quick' in name else 'bench-load'}` "
        f"({meta.get('wall_s', 0) / 60:.0f} min). Rerun it to regenerate this file and the plot.",
        "",
        f"- Machine: {meta['cpu']}, no GPU. Target (Triton + gateway) pinned to core(s) "
        f"{meta['cloud_cores']}; every edge session on core(s) {meta['edge_cores']}, replaying "
        "recorded drafts of the real ONNX draft (see `bench/replay.py`).",
        f"- Pair: target `{Path(meta['target']).name}` "
        f"({meta.get('target_weights', 'float32')} weights), draft "
        f"`{Path(meta['draft']).name}`; code prompts ({plan['prompts']}) with the chat template; "
        f"edge k = {meta['k']} capped by the cloud's hint; {plan['max_new_tokens']} new tokens "
        "per generation; RTT 0 (loopback).",
        f"- N closed-loop workers per row; tokens counted over a {plan['window_s']:g} s steady "
        "window that starts when every session has its first token.",
        "",
        "Replay check (one session live, one replayed, per temperature): "
        + "; ".join(
            f"T={t}: output identical {c['same_output']}, "
            f"{c['blocks_identical']}/{c['blocks_compared']} Draft blocks identical"
            for t, c in meta.get("replay_check", {}).items()
        ),
        f"Replay during the measurement: {meta.get('replay', {})} (misses were drafted live).",
        "",
        "![aggregate tokens/s vs N](" + f"{name}.png)",
        "",
    ]
    for t in sorted({t for _, t, _ in s}):
        lines += [
            f"## T = {t:g}",
            "",
            "| N | mode | agg tok/s | split/cloud | TTFT p50/p95 s | ITL p50/p95 ms "
            "| passes/token | rows/pass | sessions/pass | hint | k sent |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for n in sorted({n for _, tt, n in s if tt == t}):
            for mode in ("split", "cloud-only"):
                v = s.get((mode, t, n))
                if v is None:
                    continue
                other = s.get(("cloud-only", t, n))
                ratio = f"{v['tok_s'] / other['tok_s']:.2f}x" if mode == "split" and other else ""
                lines.append(
                    f"| {n} | {mode} | {v['tok_s']:.1f} | {ratio} | "
                    f"{v['ttft_p50']:.2f} / {v['ttft_p95']:.2f} | "
                    f"{v['itl_p50']:.0f} / {v['itl_p95']:.0f} | {v['passes_per_token']:.2f} | "
                    f"{v['rows_per_pass']:.1f} | {v['sessions_per_pass']:.1f} | "
                    + (f"{_fig(v['hint'])} | {v['k']:.1f} |" if mode == "split" else "- | - |")
                )
        lines.append("")
    lines += ["## Targets (greedy)", "", "| target | measured | |", "|---|---|---|"]
    for target, figs, met in targets(s):
        lines.append(f"| {target} | {figs} | {'met' if met else 'MISSED'} |")
    lines += ["", __doc__.split("\n", 2)[2]]
    path = out / f"{name}.md"
    path.write_text("\n".join(lines) + "\n")
    return path
