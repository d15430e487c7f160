"""`specsplit-edge` as a user runs it: real processes against the real cloud fixture."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specsplit.shared.tiny import reference_greedy

pytestmark = pytest.mark.slow
EDGE = str(Path(sys.executable).parent / "specsplit-edge")  # the installed console script


def edge(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([EDGE, *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def draft_with_tokenizer(tiny, tmp_path_factory) -> Path:
    """The tiny draft's export with a tokenizer beside it, as a real export has: what the CLI
    would decode its output with, were it to."""
    from tokenizers import Tokenizer, models

    out = tmp_path_factory.mktemp("draft") / "export"
    shutil.copytree(tiny.draft_onnx, out)
    Tokenizer(models.WordLevel({"a": 0}, unk_token="a")).save(str(out / "tokenizer.json"))
    return out


@pytest.mark.parametrize("mode", ["split", "cloud-only", "edge-only"])
def test_generate_json(cloud, tiny, draft_with_tokenizer, mode):
    r = edge(
        "generate",
        "--server",
        cloud.address,
        "--draft",
        str(draft_with_tokenizer),
        "--prompt-ids",
        "1,2,3,4,5",
        "--max-new-tokens",
        "12",
        "--max-draft-tokens",
        "3",
        "--route",
        mode,
        "--json",
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    expected_from = tiny.draft if mode == "edge-only" else tiny.target
    assert out["token_ids"] == reference_greedy(expected_from, [1, 2, 3, 4, 5], 12)
    for key in (
        "text",
        "new_tokens",
        "rounds",
        "drafted",
        "accepted",
        "acceptance_rate",
        "tokens_per_round",
        "wall_s",
        "tokens_per_s",
        "route",
    ):
        assert key in out
    assert out["route"] == mode and out["new_tokens"] == 12
    # token ids in, token ids out, whichever the route, though the draft has a tokenizer
    assert out["text"] is None


def test_export_writes_a_loadable_draft(tiny, tmp_path):
    r = edge("export", "--draft", str(tiny.draft), "--out", str(tmp_path / "d"), timeout=300)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "d" / "model.onnx").is_file()


def test_bad_arguments_give_clear_errors(cloud, tiny):
    r = edge("generate", "--draft", "no-such-model", "--prompt-ids", "1,2")
    assert r.returncode == 2 and "unknown model 'no-such-model'" in r.stderr
    r = edge(
        "generate",
        "--server",
        cloud.address,
        "--route",
        "cloud-only",
        "--prompt-ids",
        "1,99999",
    )
    assert r.returncode == 2 and "INVALID_ARGUMENT" in r.stderr and "vocabulary" in r.stderr
    r = edge(
        "generate",
        "--server",
        cloud.address,
        "--draft",
        str(tiny.draft_onnx),
        "--prompt-ids",
        "1,99999",
    )
    assert r.returncode == 2 and "outside the draft's vocabulary" in r.stderr
    r = edge("generate", "--route", "cloud-only", "--prompt-ids", "1,x")
    assert r.returncode != 0 and "comma-separated integers" in r.stderr


def test_generate_without_draft_uses_the_cached_default_draft(tiny, tmp_path, monkeypatch):
    """No --draft: the default draft's cached export, found without converting anything."""
    from specsplit.edge.models import DEFAULT_DRAFT, DEFAULT_PRECISION, export_dir
    from specsplit.shared.weights.sources import SOURCES

    monkeypatch.setenv("SPECSPLIT_CACHE", str(tmp_path))
    default = export_dir(SOURCES[DEFAULT_DRAFT], DEFAULT_PRECISION)
    shutil.copytree(tiny.draft_onnx, default)
    args = ("generate", "--route", "edge-only", "--prompt-ids", "1,2,3", "--max-new-tokens", "6")
    r = subprocess.run(
        [EDGE, *args, "--json"], capture_output=True, text=True, timeout=120, env=os.environ
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["token_ids"] == reference_greedy(tiny.draft, [1, 2, 3], 6)
    assert not (tmp_path / "hf").exists() and not (tmp_path / "wheels").exists()


def test_a_second_invocation_starts_as_the_first_left_its_link(cloud, tiny, tmp_path, monkeypatch):
    """Each `generate` is a new process: the link the first measured is written to the cache
    (edge.link_memory) and read by the next, which starts lock-step where that link says so (a
    remembered auto run that stayed lock-step) and cloud-led where it says so (a remembered auto
    run that led and whose cloud-led passes paid)."""
    from specsplit.edge.link_memory import load_link, save_link
    from specsplit.edge.mode_switch import Yield

    args = ["generate", "--server", cloud.address, "--draft", str(tiny.draft_onnx)]
    args += ["--prompt-ids", "1,2,3,4,5", "--max-new-tokens", "12", "--json"]
    # the server's Started carries its recent step only once it has stepped: a generation with
    # a cache of its own first, so that this test does not depend on which ran before it
    monkeypatch.setenv("SPECSPLIT_CACHE", str(tmp_path / "warm-up"))
    assert edge(*args).returncode == 0
    monkeypatch.setenv("SPECSPLIT_CACHE", str(tmp_path))
    r = edge(*args)
    assert r.returncode == 0, r.stderr
    first = load_link(cloud.address)
    assert first is not None and first.step_ms > 0 and first.rtt_ms is not None
    # cold and greedy: nothing measured on the link, so cloud-led from Start (edge.session_plan)
    assert json.loads(r.stdout)["led_at_start"]
    # as after an auto run that stayed lock-step on a short link: the next starts lock-step
    stayed = first._replace(rtt_ms=0.0, led=False, lock_step=Yield(2.0, first.step_ms))
    save_link(cloud.address, stayed)
    r = edge(*args)
    assert r.returncode == 0, r.stderr
    assert not json.loads(r.stdout)["led_at_start"]
    # as after an auto run that led, and whose cloud-led passes paid: 2 tokens a pass at the
    # remembered step's pace, twice cloud-only's (Link.led_pays compares with one token per
    # step_ms; a fixed pass time would not pay where this machine steps the tiny target faster)
    led = Yield(2.0, first.step_ms)
    save_link(cloud.address, first._replace(led=True, lock_step=None, cloud_led=led))
    r = edge(*args)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["led_at_start"] and out["route"] == "split"
    assert out["token_ids"] == reference_greedy(tiny.target, [1, 2, 3, 4, 5], 12)
    assert load_link(cloud.address).led  # renewed by the second run
