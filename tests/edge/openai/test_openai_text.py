"""TextStream: deltas never retracted, stop strings cut at the edge, split characters held back."""

from __future__ import annotations

import pytest

from specsplit.edge.openai.text import TextStream, held_back


def chars(ids: list[int]) -> str:
    """A toy decode: one character per id."""
    return "".join(chr(i) for i in ids)


def ids_of(text: str) -> list[int]:
    return [ord(c) for c in text]


def stream_text(text: str, stops: list[str], chunk: int = 1) -> tuple[list[str], TextStream]:
    s = TextStream(chars, stops)
    ids = ids_of(text)
    deltas = []
    for i in range(0, len(ids), chunk):
        deltas.append(s.push(ids[i : i + chunk]))
        if s.stopped:
            break
    deltas.append(s.flush())
    return deltas, s


def test_held_back_is_the_longest_stop_prefix_at_the_end():
    assert held_back("hello wor", ["world"]) == 3
    assert held_back("hello", ["world"]) == 0
    assert held_back("ab", ["abc", "bx"]) == 2
    assert held_back("xworl", ["world"]) == 4
    assert held_back("world", ["world"]) == 0  # a whole stop is find_stop's, not held back


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_stop_string_cuts_the_text_and_ends_the_stream(chunk):
    deltas, s = stream_text("one two three four", ["three"], chunk)
    assert "".join(deltas) == "one two "
    assert s.stopped and s.text == "one two "


def test_text_that_only_looks_like_a_stop_is_released():
    deltas, s = stream_text("a thr the end", ["three"])
    assert "".join(deltas) == "a thr the end"
    assert not s.stopped
    # "thr" waits until the space shows it is not "three"
    assert "thr" not in deltas


def test_a_stop_prefix_at_the_very_end_is_flushed():
    deltas, s = stream_text("ends with thr", ["three"])
    assert "".join(deltas[:-1]) == "ends with "
    assert deltas[-1] == "thr"


def test_earliest_of_several_stops_wins():
    deltas, _ = stream_text("xx END yy STOP", ["STOP", "END"], chunk=20)
    assert "".join(deltas) == "xx "


def test_incomplete_characters_wait_for_their_last_byte():
    def decode(ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    s = TextStream(decode)
    data = "a€b".encode()  # € is three bytes
    deltas = [s.push([b]) for b in data] + [s.flush()]
    assert deltas == ["a", "", "", "€", "b", ""]


def test_without_stops_everything_is_released_at_once():
    s = TextStream(chars)
    assert s.push(ids_of("abc")) == "abc"
    assert s.flush() == ""


def test_each_push_decodes_a_window_not_the_whole_completion():
    """Linear, not quadratic: 2,000 single-token pushes decode a few tokens each (re-decoding
    everything decoded 2 million)."""
    decoded = []

    def counting(ids: list[int]) -> str:
        decoded.append(len(ids))
        return chars(ids)

    s = TextStream(counting, ["STOP"])
    text = "".join(chr(97 + i % 26) for i in range(2000))
    deltas = [s.push([i]) for i in ids_of(text)] + [s.flush()]
    assert "".join(deltas) == text
    assert sum(decoded) < 10 * len(text)


SAMPLE = "naïve café — 東京 👋🏽 déjà vu, über straße.\n  indented  twice  ünïcödé 🎉 end"


def _trained(kind: str):
    from tokenizers import ByteLevelBPETokenizer, SentencePieceBPETokenizer

    cls = ByteLevelBPETokenizer if kind == "byte-level" else SentencePieceBPETokenizer
    tok = cls()
    tok.train_from_iterator([SAMPLE] * 4, vocab_size=300, min_frequency=1)
    return tok


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece"])
def test_windowed_deltas_equal_the_whole_decode_on_real_tokenizers(kind):
    """Characters split across tokens (byte-level BPE) and a SentencePiece leading space: the
    deltas, token by token, join to what decoding the whole completion gives."""
    tok = _trained(kind)
    ids = tok.encode(SAMPLE).ids
    whole = tok.decode(ids)
    assert "straße" in whole
    s = TextStream(tok.decode, ["straße"])
    deltas = []
    for i in ids:
        deltas.append(s.push([i]))
        if s.stopped:
            break
    deltas.append(s.flush())
    assert s.stopped and "".join(deltas) == whole.split("straße")[0]
    plain = TextStream(tok.decode)
    assert "".join([plain.push([i]) for i in ids] + [plain.flush()]) == whole
