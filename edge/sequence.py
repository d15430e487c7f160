"""The committed sequence of one stream (docs/design.md#protocol): the prompt and every token both
sides agreed on, owned by the stream's loop, never by the transport.

edge.rounds creates a ``Committed`` from the prompt it opens the stream with and hands it to the
loop of the session's mode (edge.lockstep, edge.cloud_led, edge.cloud_only), which commits each
Verdict's chunk through ``commit``: the chunk is appended and the proto's invariant checked
(both sides agree on committed_len) before the loop hands the chunk on.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from specsplit.edge.stream import reason_name, rpc_error
from specsplit.shared.protocol import pb


class Committed:
    """The prompt and the tokens committed after it; ``final``: the finish reason once the final
    Verdict was committed (and agreed), "" before."""

    def __init__(self, prompt: Sequence[int]) -> None:
        self.tokens: list[int] = list(prompt)  # own copy: the caller keeps its own list
        self.final = ""

    def __len__(self) -> int:
        return len(self.tokens)

    def commit(self, chunk: Sequence[int], v: pb.Verdict) -> None:
        """Appends Verdict ``v``'s ``chunk``; then both sides must agree on committed_len, or
        the stream fails as UNAVAILABLE before the chunk is handed on, so that the generation
        re-opens from the prefix both last agreed on (edge.retry)."""
        self.tokens += chunk
        if v.committed_len != len(self.tokens):
            raise rpc_error(
                grpc.StatusCode.UNAVAILABLE,
                f"the cloud's Verdict of round {v.round} says committed_len {v.committed_len}, "
                f"the edge committed {len(self.tokens)} (accepted {v.accepted}, "
                f"has_token {v.has_token}): re-opening from the edge's last agreed prefix",
            )
        if v.finished:
            self.final = reason_name(v.reason)
