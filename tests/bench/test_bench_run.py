"""`make bench`'s own loop on the real stack, small: a full run takes two hours, so a broken record,
resume or report must show up here first. Real tritonserver and gateway (the tiny target), a real
ONNX Runtime draft, the real delay proxy; only the plan is small."""

import asyncio
import json

import pytest

from bench.report import write_report
from bench.run import BenchPlan, run_all, run_meta
from specsplit.edge.onnx_drafter import OnnxDrafter

PROMPTS = (
    {"id": "code-t", "class": "code", "prompt": "def add(a, b):"},
    {"id": "prose-t", "class": "prose", "prompt": "A hash table is"},
)


class ByteIds:
    """The tiny models have no tokenizer: a prompt's bytes are its ids (vocab 256)."""

    def chat_prompt(self, text: str) -> list[int]:
        return list(text.encode())


@pytest.fixture(scope="module")
def bench_run(cloud, tiny, tmp_path_factory):
    """One small bench: two conditions (RTT 0 direct, the LTE-like link through the proxy), both
    temperatures, every mode, a draft that disagrees with the target (rejections, mode switches)."""
    out = tmp_path_factory.mktemp("bench")
    plan = BenchPlan((2,), 4, (0.0, 0.7), (0.0,), True, PROMPTS, 6)
    raw = out / "benchmarks-raw.jsonl"
    drafter = OnnxDrafter(tiny.draft_onnx)
    links = out / "links.json"
    asyncio.run(run_all(plan, cloud.address, drafter, ByteIds(), raw, set(), links))
    meta = run_meta(plan, tiny.target, tiny.draft_onnx, "fp32", "auto", {0}, {1}) | {"wall_s": 1.0}
    (out / "benchmarks-meta.json").write_text(json.dumps(meta))
    return plan, raw, drafter, out


def test_every_planned_generation_is_recorded_once(bench_run):
    plan, raw, _, _ = bench_run
    records = [json.loads(line) for line in raw.read_text().splitlines()]
    assert len(records) == plan.planned
    runs = {(r["key"], r["prompt_id"], r["sample"]) for r in records}
    assert len(runs) == len(records)
    planned = {(c.key, p["id"], j) for c, j in plan.schedule() for p in plan.prompts}
    assert runs == planned
    assert all(r["new_tokens"] == plan.max_new_tokens for r in records)


def test_greedy_split_runs_match_cloud_only_token_for_token(bench_run):
    """The bench's own lossless check, on records it wrote: every split mode at every condition
    equals cloud-only's greedy output for the prompt (the draft is unrelated: most is rejected)."""
    _, raw, _, _ = bench_run
    records = [json.loads(line) for line in raw.read_text().splitlines()]
    greedy = [r for r in records if r["temperature"] == 0 and r["mode"] != "edge-only"]
    reference = {r["prompt_id"]: r["token_ids"] for r in greedy if r["mode"] == "cloud-only"}
    assert set(reference) == {p["id"] for p in PROMPTS}
    split = [r for r in greedy if r["mode"] != "cloud-only"]
    assert {r["mode"] for r in split} >= {"lock-step", "lock-step-adaptive", "cloud-led", "auto"}
    for r in split:
        assert r["token_ids"] == reference[r["prompt_id"]], (r["key"], r["prompt_id"])


def test_report_covers_both_classes_and_the_lte_link(bench_run):
    plan, raw, _, out = bench_run
    page = write_report(raw, out / "benchmarks-meta.json", out, "benchmarks").read_text()
    assert f"Completeness: {plan.planned} of {plan.planned} planned generations." in page
    greedy_split = sum(
        1
        for c, _ in plan.schedule()
        if c.temperature == 0 and c.mode not in ("cloud-only", "edge-only")
    ) * len(PROMPTS)
    assert (
        f"identical to the target's own (cloud-only) output: {greedy_split}/{greedy_split}" in page
    )
    for cls in ("code", "prose"):
        assert f"the best fixed k, {cls} prompts" in page
    assert "| LTE (50 ± 10 ms, 5 / 20 Mbit/s) | 0.7 | cold |" in page
    assert "| LTE (50 ± 10 ms, 5 / 20 Mbit/s) | 0.7 | warm |" in page


def test_warm_clients_read_their_link_from_a_link_memory_file(bench_run):
    """auto saves the link it measured per cell (edge.link_memory's file, as the CLI's processes
    do); auto-warm is a new client given what that file holds."""
    from specsplit.edge.link_memory import load_link

    _, _, _, out = bench_run
    links = out / "links.json"
    for prompt in PROMPTS:
        for cell in ("0//0", "50/lte/0.7"):
            link = load_link(f"{cell}/{prompt['id']}", links)
            assert link is not None and link.step_ms > 0, (cell, prompt["id"])


def test_resume_runs_nothing_twice(bench_run, cloud):
    """--resume: what the raw file holds is skipped, the rest appended."""
    plan, raw, drafter, _ = bench_run
    lines = raw.read_text().splitlines()
    keep = [json.loads(line) for line in lines[:-3]]
    resumed = raw.with_name("resumed-raw.jsonl")
    resumed.write_text("".join(json.dumps(r) + "\n" for r in keep))
    done = {(r["key"], r["prompt_id"], r["sample"]) for r in keep}
    links = raw.with_name("resumed-links.json")
    asyncio.run(run_all(plan, cloud.address, drafter, ByteIds(), resumed, done, links))
    records = [json.loads(line) for line in resumed.read_text().splitlines()]
    assert len(records) == plan.planned
    assert len({(r["key"], r["prompt_id"], r["sample"]) for r in records}) == plan.planned
