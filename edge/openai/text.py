"""Committed tokens -> text deltas for the OpenAI endpoint, with stop strings matched at the edge.

The cloud stops on token ids; OpenAI's ``stop`` is strings, which only exist once tokens are
decoded, so they are matched here on the decoded text. A delta, once sent, cannot be taken back:
``TextStream`` releases only text that can no longer change or turn out to be part of a stop
string. It holds back a trailing incomplete UTF-8 sequence (decoded as U+FFFD until its last byte
arrives) and the longest tail of the text that is a proper prefix of some stop string.
The deltas joined, plus ``flush()``, equal the final text: the decoded completion cut before the
first stop string.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


def held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> int:
    """Index of the earliest occurrence of any stop string at or after ``start``, or -1."""
    found = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(found) if found else -1


class TextStream:
    """Decodes a growing list of token ids; ``push`` returns the text that is safe to send."""

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = ()):
        self.decode = decode
        self.stops = [s for s in stops if s]
        self.ids: list[int] = []
        self.text = ""  # the decoded text so far, cut before a stop string once one matched
        self.sent = 0  # characters of ``text`` already released
        self.stopped = False  # a stop string matched: the completion is over

    def push(self, tokens: list[int]) -> str:
        assert not self.stopped, "push after a stop string matched"
        self.ids += tokens
        self.text = self.decode(self.ids)
        # A stop string may begin inside the held-back tail, never inside what was sent.
        longest = max((len(s) for s in self.stops), default=0)
        at = find_stop(self.text, self.stops, max(0, self.sent - longest + 1))
        if at >= 0:
            self.stopped = True
            self.text = self.text[: max(at, self.sent)]
            return self._release(len(self.text))
        safe = len(self.text.rstrip(REPLACEMENT))
        safe -= held_back(self.text[:safe], self.stops)
        return self._release(safe)

    def flush(self) -> str:
        """The rest of the text, once no more tokens will come."""
        return self._release(len(self.text))

    def _release(self, end: int) -> str:
        if end <= self.sent:
            return ""
        delta, self.sent = self.text[self.sent : end], end
        return delta
