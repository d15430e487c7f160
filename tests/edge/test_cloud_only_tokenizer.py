"""A cloud-only generation drafts nothing, so it fetches and exports no draft: token ids need
none, and a text prompt reads the tokenizer of a draft already in the cache (issue 41)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from specsplit.edge import cli
from specsplit.edge.models import DEFAULT_DRAFT, export_dir
from specsplit.shared.weights.sources import SOURCES, hf_dir_path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSPLIT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def exports(monkeypatch):
    """Every call of ensure_draft_onnx, which would fetch and export the draft."""
    calls = []

    def ensure_draft_onnx(spec, precision, progress=True):
        calls.append(spec)
        raise AssertionError(f"{spec} fetched and exported for a cloud-only generation")

    monkeypatch.setattr(cli, "ensure_draft_onnx", ensure_draft_onnx)
    return calls


def save_tokenizer(d):
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    d.mkdir(parents=True)
    tok.save(str(d / "tokenizer.json"))
    return d


def args(*argv: str):
    return cli._parser().parse_args(["generate", "--mode", "cloud-only", *argv])


def test_token_ids_need_no_draft(cache, exports):
    a = args("--prompt-ids", "1,2")
    assert cli._draft_dir(a) is None and cli._codec(a, None) is None
    assert exports == []


@pytest.mark.parametrize("where", ["hf", "export"])
def test_a_text_prompt_reads_the_cached_tokenizer_without_exporting(cache, exports, where):
    source = SOURCES[DEFAULT_DRAFT]
    d = save_tokenizer(hf_dir_path(source) if where == "hf" else export_dir(source, "int8"))
    a = args("--prompt", "hello world")
    assert cli._draft_dir(a) == d
    assert cli._codec(a, d).encode("hello world") == [1, 2]
    assert exports == []


def test_a_draft_dir_given_is_read_as_it_is(cache, exports, tmp_path):
    d = save_tokenizer(tmp_path / "my-draft")
    assert cli._draft_dir(args("--prompt", "hello", "--draft", str(d))) == d
    assert exports == []


def test_with_nothing_cached_the_draft_is_still_fetched_for_its_tokenizer(cache, exports):
    with pytest.raises(AssertionError, match="fetched and exported"):
        cli._draft_dir(args("--prompt", "hello"))
    assert exports == [DEFAULT_DRAFT]
