"""edge.export.token_freq and the partial LM head it ranks (edge.export.exporter.head_rows)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from specsplit.edge.export import token_freq
from specsplit.edge.export.exporter import export_onnx, head_rows
from specsplit.edge.export.families import read_spec
from tests.shared.test_tokenizer_fingerprint import save as save_tokenizer

QWEN_TOKENIZER = Path.home() / ".cache/specsplit/hf/qwen2.5-coder-0.5b-instruct/tokenizer.json"
# a vocabulary the size of the tiny model's (256 ids), "<|end|>" special after it
VOCAB = {"<unk>": 0, **{f"t{i}": i for i in range(1, 250)}}


def with_tokenizer(src: Path, dst: Path) -> Path:
    """A copy of a tiny checkpoint with a tokenizer.json (special "<|end|>" 250, added 251)."""
    shutil.copytree(src, dst)
    save_tokenizer(dst / "tokenizer.json", vocab=VOCAB)
    return dst


def table_favouring(tokenizer: Path, favourites: list[int], out: Path) -> Path:
    """A frequency table where ``favourites`` are the most frequent ids, in that order."""
    counts = np.ones(252, np.int64)  # every id seen once ...
    counts[200:] = 0  # ... but 200 and above, never
    for rank, token in enumerate(favourites):
        counts[token] = 1000 - rank
    token_freq.write_table(counts, tokenizer, out)
    return out


def test_table_ranks_ids_by_falling_count_then_id_for_its_own_tokenizer_only(tmp_path):
    tokenizer = save_tokenizer(tmp_path / "a" / "tokenizer.json", vocab=VOCAB)
    other = save_tokenizer(tmp_path / "b" / "tokenizer.json")
    counts = np.array([0, 5, 7, 5, 0, 9], np.int64)
    table = tmp_path / "freq.npz"
    token_freq.write_table(counts, tokenizer, table)
    assert token_freq.ranking(tokenizer, table).tolist() == [5, 2, 1, 3]  # 0 and 4 never seen
    assert token_freq.ranking(other, table) is None
    assert token_freq.ranking(tmp_path / "none.json", table) is None


def test_count_tokenizes_the_corpus_files_only(tmp_path):
    from tokenizers import Tokenizer

    tokenizer = save_tokenizer(tmp_path / "tok" / "tokenizer.json")
    corpus = tmp_path / "corpus"
    (corpus / "pkg").mkdir(parents=True)
    (corpus / "pkg" / "m.py").write_text("ab c")
    (corpus / "README.md").write_text("a")
    (corpus / "data.bin").write_text("cccc")  # not a corpus suffix
    expected = Tokenizer.from_file(str(tokenizer)).encode("ab c").ids + [1]  # + "a"
    counts = token_freq.count(tokenizer, corpus)
    assert counts.sum() == len(expected)
    assert counts.tolist()[:5] == np.bincount(expected, minlength=5).tolist()[:5]


def test_a_partial_lm_head_keeps_the_most_frequent_ids_and_every_special_one(qwen_dirs, tmp_path):
    model = with_tokenizer(qwen_dirs["tied"], tmp_path / "hf")
    config = json.loads((model / "config.json").read_text())
    spec = read_spec(config, has_lm_head=False)
    favourites = [199, 150, 7, 120]
    table = table_favouring(model / "tokenizer.json", favourites, tmp_path / "freq.npz")
    rows = head_rows(model, config, spec, 6, table).tolist()
    # the 4 favourites, then ids seen once by id (1, 2: 0 is <unk>, seen once too), + specials
    assert rows == sorted({*favourites, 0, 1, 250, 251})
    # past the ids the corpus showed (1..199), the unseen follow by id: 200, 201, ...
    wide = head_rows(model, config, spec, 202, table).tolist()
    assert wide == sorted({*range(200), 200, 201, 250, 251})


def test_the_export_ranks_its_head_by_the_table(qwen_dirs, tmp_path, monkeypatch):
    model = with_tokenizer(qwen_dirs["tied"], tmp_path / "hf")
    favourites = [199, 150, 7, 120]
    table = table_favouring(model / "tokenizer.json", favourites, tmp_path / "freq.npz")
    monkeypatch.setattr(token_freq, "TABLE", table)
    out = export_onnx(model, tmp_path / "part", precision="fp32", head_vocab=4)
    assert np.load(out / "lm_head_ids.npy").tolist() == sorted({*favourites, 250, 251})


def test_by_default_the_head_splits_only_where_the_table_ranks_the_tokenizer(
    qwen_dirs, tmp_path, monkeypatch
):
    from specsplit.edge.export import exporter

    model = with_tokenizer(qwen_dirs["tied"], tmp_path / "hf")
    favourites = [199, 150, 7, 120]
    table = table_favouring(model / "tokenizer.json", favourites, tmp_path / "freq.npz")
    monkeypatch.setattr(token_freq, "TABLE", table)
    monkeypatch.setattr(exporter, "DEFAULT_HEAD_VOCAB", 4)
    out = export_onnx(model, tmp_path / "split", precision="fp32")
    assert np.load(out / "lm_head_ids.npy").tolist() == sorted({*favourites, 250, 251})
    # no tokenizer.json, so no table ranks it: one head over every id
    whole = export_onnx(qwen_dirs["tied"], tmp_path / "whole", precision="fp32")
    assert not (whole / "lm_head_ids.npy").exists()
    one = export_onnx(model, tmp_path / "one", precision="fp32", head_vocab=0)
    assert not (one / "lm_head_ids.npy").exists()


def test_without_a_table_for_its_tokenizer_the_head_keeps_the_lowest_ids(qwen_dirs):
    model = qwen_dirs["tied"]  # no tokenizer.json: no table can be its tokenizer's
    config = json.loads((model / "config.json").read_text())
    spec = read_spec(config, has_lm_head=False)
    rows = head_rows(model, config, spec, 10)
    assert rows.tolist()[:10] == list(range(10))


@pytest.mark.skipif(not QWEN_TOKENIZER.exists(), reason="the Qwen2.5 tokenizer is not cached")
def test_the_shipped_table_is_the_qwen2_tokenizers_and_small():
    from tokenizers import Tokenizer

    assert token_freq.TABLE.stat().st_size < 1 << 20
    ranked = token_freq.ranking(QWEN_TOKENIZER)
    assert ranked is not None and len(ranked) > 30_000
    assert len(set(ranked.tolist())) == len(ranked)
    tokenizer = Tokenizer.from_file(str(QWEN_TOKENIZER))
    top = set(ranked[:200].tolist())
    for text in ("\n", " the", " =", "(", "."):  # code and prose alike
        assert tokenizer.encode(text).ids[0] in top, text
