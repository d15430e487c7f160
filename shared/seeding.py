"""Per-round random generators.

Randomness is a function of (seed, side, position), not a stream that advances with each call:
a session re-opened after a cloud failure (docs/design.md#failure) draws the very same numbers at
the same positions, so the output is unchanged. The verifier's accept tests and corrections use a
stream of their own (``side`` "verify"): a draft drawn with the numbers an accept test reads would
bias that test. The numbers both sides do share (shared/coupling.py) only feed draws that no accept
test reads.
"""

from __future__ import annotations

import zlib

import numpy as np


def round_rng(seed: int, side: str, base_len: int) -> np.random.Generator:
    """Generator for the round that continues from ``base_len`` committed tokens."""
    side_key = zlib.crc32(side.encode())
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(side_key, base_len)))
