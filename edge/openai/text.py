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
    """Decodes a growing list of token ids; ``push`` returns the text that is safe to send.

    Incremental: each push decodes only a window, the ids from the last release on (a prefix
    window ``ids[prefix:read]`` and the whole ``ids[prefix:]``; the new text is what the second
    adds), as TGI and vLLM detokenise, so a long completion costs linear time, not quadratic.
    Decoding both from the same start keeps what a tokenizer does at the start of a text
    (a SentencePiece leading space) out of the deltas.
    """

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = ()):
        self.decode = decode
        self.stops = [s for s in stops if s]
        self.ids: list[int] = []
        self._prefix = self._read = 0  # the window: ids[_prefix:_read] decoded to text already
        self._released: list[str] = []  # the text sent, in deltas
        self._tail = ""  # the last characters sent, enough to find a stop that begins there
        self._pending = ""  # decoded, not yet released
        self.stopped = False  # a stop string matched: the completion is over

    @property
    def text(self) -> str:
        """The decoded text so far, cut before a stop string once one matched."""
        return "".join(self._released) + self._pending

    def push(self, tokens: list[int]) -> str:
        assert not self.stopped, "push after a stop string matched"
        self.ids += tokens
        self._pending += self._decoded(final=False)
        # A stop string may begin inside the held-back tail, never inside what was sent.
        window = self._tail + self._pending
        at = find_stop(window, self.stops)
        if at >= 0:
            self.stopped = True
            self._pending = window[len(self._tail) : max(at, len(self._tail))]
            return self._release(len(self._pending))
        safe = len(self._pending.rstrip(REPLACEMENT))
        safe -= held_back(self._pending[:safe], self.stops)
        return self._release(safe)

    def flush(self) -> str:
        """The rest of the text, once no more tokens will come."""
        if not self.stopped:
            self._pending += self._decoded(final=True)
        return self._release(len(self._pending))

    def _decoded(self, final: bool) -> str:
        """The text the ids since the window's end add; "" while it ends in an incomplete
        character (unless ``final``), which the next ids may complete."""
        if self._read == len(self.ids):
            return ""
        before = self.decode(self.ids[self._prefix : self._read]) if self._read else ""
        after = self.decode(self.ids[self._prefix :])
        if len(after) <= len(before) or (after.endswith(REPLACEMENT) and not final):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return after[len(before) :]

    def _release(self, end: int) -> str:
        if end <= 0:
            return ""
        delta, self._pending = self._pending[:end], self._pending[end:]
        self._released.append(delta)
        longest = max((len(s) for s in self.stops), default=0)
        self._tail = (self._tail + delta)[-(longest - 1) :] if longest > 1 else ""
        return delta
