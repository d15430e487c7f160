"""make bench-peers without running anything: rows, llama-server command lines, the report's
figures and table from sample records. Nothing here builds or starts llama.cpp."""

from pathlib import Path

import pytest

from bench import llama_cpp
from bench.peers import PLANS, Row, Setup, llama_command, make_rows, record
from bench.peers_report import (
    acceptance,
    agreement,
    best_draft,
    by_row,
    markdown_table,
    render,
    summary,
    write_report,
)

ONE, BOTH = (1,), (0, 1)


def rec(row: Row, prompt="code-00", cls="code", new=64, wall=8.0, ids=None, **extra) -> dict:
    ids = list(range(new)) if ids is None else ids
    return record(row, {"id": prompt, "class": cls}, ids, wall, **extra)


def sample_records() -> list[dict]:
    out = []
    for row in make_rows(PLANS["full"], ONE, BOTH):
        wall = {
            "llama.cpp/target/t1": 8.0,
            "llama.cpp/target/t2": 4.0,
            "llama.cpp/speculative/t2/n4": 3.0,
            "llama.cpp/speculative/t2/n8": 2.0,
            "llama.cpp/speculative/t2/n16": 2.5,
            "transformers/target/t1": 32.0,
            "transformers/assisted/t2": 16.0,
            "specsplit/cloud-only/t1": 16.0,
            "specsplit/split/t2": 8.0,
        }[row.key]
        out.append(rec(row, wall=wall, draft_n=10, draft_n_accepted=8))
        out.append(rec(row, "prose-00", "prose", wall=wall * 2, draft_n=10, draft_n_accepted=6))
    return out


def sample_meta(rows) -> dict:
    return {
        "date": "2026-01-01 00:00 UTC",
        "commit": "abc123",
        "cpu": "AMD EPYC",
        "cpu_flags": ["avx2", "fma"],
        "cores": 2,
        "plan": {"prompt_ids": ["code-00", "prose-00"], "max_new_tokens": 64},
        "rows": {r.key: {"cores": list(r.cores), "command": ["x"]} for r in rows},
        "versions": {"python": "3.11"},
        "wall_s": 600,
    }


def test_rows_cover_every_peer_on_the_right_cores():
    rows = {r.key: r for r in make_rows(PLANS["full"], ONE, BOTH)}
    assert rows["llama.cpp/target/t1"].cores == ONE
    assert rows["llama.cpp/target/t2"].cores == BOTH
    assert {k for k in rows if "speculative" in k} == {
        f"llama.cpp/speculative/t2/n{n}" for n in (4, 8, 16)
    }
    assert rows["transformers/target/t1"].cores == ONE
    assert rows["transformers/assisted/t2"].cores == BOTH
    assert rows["specsplit/cloud-only/t1"].cores == ONE
    assert rows["specsplit/split/t2"].cores == BOTH


def test_plans_generate_64_tokens_on_code_and_prose_and_quick_is_small():
    full, quick = PLANS["full"], PLANS["quick"]
    assert full.max_new_tokens == 64
    assert any(i.startswith("code") for i in full.prompt_ids)
    assert any(i.startswith("prose") for i in full.prompt_ids)
    assert len(quick.prompt_ids) == 1 and quick.max_new_tokens < full.max_new_tokens


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


def test_summary_orders_rows_and_compares_with_llama_cpp_two_threads():
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
    ]
    s = {x["key"]: x for x in summ}
    # 128 tokens over 4 + 8 s; code alone 64 / 4 s
    assert s["llama.cpp/target/t2"]["tok_s"] == pytest.approx(128 / 12)
    assert s["llama.cpp/target/t2"]["code"] == pytest.approx(16.0)
    assert s["llama.cpp/target/t1"]["vs_base"] == pytest.approx(0.5)
    assert s["specsplit/split/t2"]["same"] == "2/2"


def test_markdown_table_has_one_line_per_row():
    table = markdown_table(summary(by_row(sample_records())))
    lines = table.splitlines()
    assert len(lines) == 2 + 7
    assert lines[4].startswith("| 3 | llama.cpp speculative (-md draft), 2 threads, draft max 8 |")
    assert "| 2.00× |" in lines[4]  # 128 / 6 s against 128 / 12 s


def test_report_renders_from_raw_and_meta(tmp_path: Path):
    import json

    records = sample_records()
    rows = make_rows(PLANS["full"], ONE, BOTH)
    raw, meta = tmp_path / "peers-raw.jsonl", tmp_path / "peers-meta.json"
    raw.write_text("".join(json.dumps(r) + "\n" for r in records))
    meta.write_text(json.dumps(sample_meta(rows)))
    text = write_report(raw, meta, tmp_path / "peers.md").read_text()
    assert "| draft max | tok/s | acceptance |" in text
    assert "| 16 | 17.07 |" in text  # 128 / 7.5 s
    assert "AMD EPYC" in text and "`abc123`" in text
    assert render(records[:2], sample_meta(rows[:1]))  # a stopped run still reports


def test_spec_flags_prefer_the_new_names_and_fall_back():
    new = (
        "--spec-draft-n-max N ...\n--draft, --draft-n, --draft-max N  the argument has been removed"
    )
    assert llama_cpp.spec_flags(new) == ("--spec-draft-n-max", "--spec-draft-n-min")
    assert llama_cpp.spec_flags("--draft-max N\n--draft-min N") == ("--draft-max", "--draft-min")


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
    target = llama_command(Row("llama.cpp", "target", ONE), setup, 1234)
    assert "-md" not in target and target[-1] == "--no-repack"
    spec = llama_command(Row("llama.cpp", "speculative", BOTH, 16), setup, 1234)
    assert spec[spec.index("--spec-draft-n-max") + 1] == "16"


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
