"""A cloud-only generation drafts nothing, so it fetches and exports no draft: token ids need
none, and a text prompt reads the tokenizer of a draft already in the cache, or the one its
cached GGUF holds (issue 41)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from specsplit.edge import cli, gguf_tokenizer
from specsplit.edge.models import DEFAULT_DRAFT, export_dir
from specsplit.shared.tokenizer_fingerprint import tokenizer_fingerprint
from specsplit.shared.weights import sources
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
    return cli._parser().parse_args(["generate", "--route", "cloud-only", *argv])


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


def place_gguf(cache, target=None):
    """The default draft's GGUF in ``cache`` as `fetch` leaves it: the file and its verified
    marker. ``target``: a real GGUF to link to, else a stand-in of a few bytes."""
    source = SOURCES[DEFAULT_DRAFT]
    gguf = cache / "gguf" / source.gguf_file
    gguf.parent.mkdir(parents=True)
    if target is None:
        gguf.write_bytes(b"GGUF")
    else:
        gguf.symlink_to(target)
    sources._write_marker(gguf, source)
    return gguf


@pytest.fixture
def reads(monkeypatch):
    """Every read of a GGUF's tokenizer (transformers' converter): a tiny tokenizer instead."""
    calls = []

    def read_tokenizer(gguf, out):
        calls.append(gguf)
        save_tokenizer(out / "sub")
        (out / "sub" / "tokenizer.json").rename(out / "tokenizer.json")
        (out / "sub").rmdir()

    monkeypatch.setattr(gguf_tokenizer, "read_tokenizer", read_tokenizer)
    return calls


def test_a_cached_gguf_gives_the_tokenizer_once_without_exporting(cache, exports, reads, capsys):
    gguf = place_gguf(cache)
    a = args("--prompt", "hello world")
    d = cli._draft_dir(a)
    assert d == gguf_tokenizer.tokenizer_dir(SOURCES[DEFAULT_DRAFT]) and d.parent.parent == cache
    assert cli._codec(a, d).encode("hello world") == [1, 2]
    assert cli._draft_dir(a) == d  # kept: read once
    assert reads == [gguf] and exports == []
    assert f"reading the tokenizer from {gguf}" in capsys.readouterr().err
    assert not [p for p in d.parent.iterdir() if p.name.endswith(".tmp")]


def test_without_transformers_a_cached_gguf_says_what_to_give_instead(
    cache, exports, reads, monkeypatch, capsys
):
    gguf = place_gguf(cache)
    monkeypatch.setattr(gguf_tokenizer, "_installed", lambda m: m != "transformers")
    assert cli.main(["generate", "--route", "cloud-only", "--prompt", "hello"]) == 2
    err = capsys.readouterr().err
    assert str(gguf) in err and "transformers" in err and "'.[export]'" in err, err
    assert "--prompt-ids" in err and "Traceback" not in err
    assert reads == [] and exports == []


@pytest.mark.slow
def test_the_tokenizer_read_from_the_real_gguf_is_the_converted_directorys(
    cache, exports, real_cache
):
    """The default draft's real GGUF, where this machine's cache has it (read only: linked into
    a temporary cache): the same ids and specials as its converted Hugging Face directory."""
    home = real_cache
    source = SOURCES[DEFAULT_DRAFT]
    found = home / "gguf" / source.gguf_file
    converted = home / "hf" / source.name / "tokenizer.json"
    if not (found.is_file() and converted.is_file()):
        pytest.skip(f"the default draft's GGUF and its conversion are not in {real_cache}")
    place_gguf(cache, target=found)
    d = cli._draft_dir(args("--prompt", "def quicksort(a):"))
    assert tokenizer_fingerprint(d / "tokenizer.json") == tokenizer_fingerprint(converted)
    assert cli._codec(args("--prompt", "x"), d).chat_template is not None
    assert exports == []
