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
