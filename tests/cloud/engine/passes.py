"""Driving a forward (``RaggedForward``, ``KernelForward``) the two ways batch invariance compares:
sessions advancing together in ragged blocks, and one session stepped alone a row per pass."""

from __future__ import annotations

import numpy as np
import torch

from specsplit.cloud.engine.ragged import Segment


def stepped_alone(forward, seq: list[int], sid: int = 100) -> torch.Tensor:
    """[len(seq) - 1, vocab]: the first token prefilled, then one row per pass."""
    slot = forward.slots.open(sid)
    forward([Segment(slot, seq[:1], want_logits=False)])
    rows = [forward([Segment(slot, [t], want_logits=True)])[0] for t in seq[1:]]
    forward.slots.free(sid)
    return torch.cat(rows)


def ragged_passes(
    forward, sequences: list[list[int]], rng: np.random.Generator, max_rows: int
) -> list[torch.Tensor]:
    """Every sequence's logits for positions 1.. (as ``stepped_alone``), with all sessions in each
    pass, each taking a block of 1..max_rows rows (drawn from ``rng``) until it is done."""
    slots = [forward.slots.open(sid) for sid in range(len(sequences))]
    forward(
        [Segment(slot, s[:1], want_logits=False) for slot, s in zip(slots, sequences, strict=True)]
    )
    got: list[list[torch.Tensor]] = [[] for _ in sequences]
    while any(slot.length < len(s) for slot, s in zip(slots, sequences, strict=True)):
        segments, owners = [], []
        for sid, (slot, s) in enumerate(zip(slots, sequences, strict=True)):
            if slot.length < len(s):
                n = int(rng.integers(1, max_rows + 1))
                segments.append(Segment(slot, s[slot.length : slot.length + n], True))
                owners.append(sid)
        for sid, logits in zip(owners, forward(segments), strict=True):
            got[sid].append(logits)
    return [torch.cat(rows) for rows in got]
