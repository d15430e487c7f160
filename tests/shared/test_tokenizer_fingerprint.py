"""shared.tokenizer_fingerprint: what it hashes (ids and special tokens), what it ignores, and the
documented algorithm reproduced byte for byte."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from specsplit.shared.tokenizer_fingerprint import tokenizer_fingerprint

VOCAB = {"<unk>": 0, "a": 1, "b": 2, "ab": 3, "c": 4, "naïve": 5, "x y\n": 6}


def save(path: Path, vocab=VOCAB, special=("<|end|>",), merges=None, lowercase=False) -> Path:
    """A tokenizer.json: BPE over ``vocab`` (+ ``merges``), ``special`` added after it."""
    from tokenizers import Tokenizer, models, normalizers

    bpe = models.BPE(vocab=dict(vocab), merges=list(merges or []), unk_token="<unk>")
    tokenizer = Tokenizer(bpe)
    if lowercase:
        tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.add_special_tokens(list(special))
    tokenizer.add_tokens(["<tool>"])  # an added token that is not special
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path


def documented(vocab: dict[str, int], special: dict[str, int]) -> str:
    """The module docstring's algorithm, written out independently."""
    digest = hashlib.sha256(b"specsplit-tokenizer-v1\n")

    def entries(pairs: dict[str, int]) -> None:
        for token_id, token in sorted((i, t) for t, i in pairs.items()):
            raw = token.encode("utf-8")
            digest.update(b"%d %d " % (token_id, len(raw)) + raw + b"\n")

    entries(vocab)
    digest.update(b"special\n")
    entries(special)
    return "v1:" + digest.hexdigest()


def test_the_documented_algorithm_byte_for_byte(tmp_path):
    got = tokenizer_fingerprint(save(tmp_path / "tokenizer.json"))
    full = {**VOCAB, "<|end|>": 7, "<tool>": 8}
    assert got == documented(full, {"<|end|>": 7})
    assert got == tokenizer_fingerprint(save(tmp_path / "again" / "tokenizer.json"))  # stable


def test_only_what_ids_mean_counts(tmp_path):
    """Merges and normalizer do not change which token an id names; they do not count."""
    base = tokenizer_fingerprint(save(tmp_path / "base.json"))
    other = save(tmp_path / "other.json", merges=[("a", "b")], lowercase=True)
    assert tokenizer_fingerprint(other) == base


@pytest.mark.parametrize(
    "change",
    [
        {"vocab": {**VOCAB, "a": 2, "b": 1}},  # two ids swapped
        {"vocab": {**VOCAB, "d": 7}},  # one more token (the special ones move up)
        {"vocab": {**{k: v for k, v in VOCAB.items() if k != "c"}, "C": 4}},  # a token renamed
        {"special": ("<|eot|>",)},  # another special token
        {"special": ("<|end|>", "<|im_start|>")},  # one more special token
    ],
)
def test_a_different_meaning_changes_it(tmp_path, change):
    base = tokenizer_fingerprint(save(tmp_path / "base.json"))
    assert tokenizer_fingerprint(save(tmp_path / "changed.json", **change)) != base


def test_gguf_padding_rows_are_ignored(tmp_path):
    """A GGUF conversion pads the vocabulary to the model's rows with [PAD<id>] tokens after the
    added ones (as Qwen2.5's 151,936 rows after 151,665 tokens): a tokenizer padded to more rows
    still matches one padded to fewer, or none."""
    vocab = {**VOCAB, "<|end|>": 7, "<tool>": 8}  # the added tokens' ids, as in the files
    plain = tokenizer_fingerprint(save(tmp_path / "plain.json", vocab=vocab))
    for rows in (10, 16):
        padded = {**vocab, **{f"[PAD{i}]": i for i in range(9, rows)}}
        assert tokenizer_fingerprint(save(tmp_path / f"{rows}.json", vocab=padded)) == plain
    odd = {**vocab, "[PAD10]": 9}  # a [PAD..] naming another id is a real token
    assert tokenizer_fingerprint(save(tmp_path / "odd.json", vocab=odd)) != plain


def test_export_records_it_and_the_drafter_reads_it(tmp_path):
    from specsplit.edge.export.exporter import export_onnx
    from specsplit.edge.onnx_drafter import OnnxDrafter
    from specsplit.shared.tiny import make_tiny_qwen2

    hf = make_tiny_qwen2(tmp_path / "hf", seed=0)
    bare = OnnxDrafter(export_onnx(hf, tmp_path / "bare"), providers=["CPUExecutionProvider"])
    assert bare.tokenizer_fingerprint is None  # exported without a tokenizer.json
    save(hf / "tokenizer.json")
    out = export_onnx(hf, tmp_path / "onnx")
    expected = tokenizer_fingerprint(hf / "tokenizer.json")
    assert json.loads((out / "specsplit_draft.json").read_text())["tokenizer_fingerprint"] == (
        expected
    )
    drafter = OnnxDrafter(out, providers=["CPUExecutionProvider"])
    assert drafter.tokenizer_fingerprint == expected
    assert tokenizer_fingerprint(out / "tokenizer.json") == expected  # the copy beside it too


def test_it_needs_neither_torch_nor_numpy(tmp_path):
    """The cloud and the edge both import it: tokenizers alone does the work."""
    path = save(tmp_path / "tokenizer.json")
    code = (
        "import sys; from specsplit.shared.tokenizer_fingerprint import tokenizer_fingerprint; "
        f"print(tokenizer_fingerprint({str(path)!r})); "
        "bad = [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules]; "
        "assert not bad, bad"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True,
        cwd=Path(__file__).parents[2],
    )  # fmt: skip
    assert run.stdout.strip() == tokenizer_fingerprint(path)
