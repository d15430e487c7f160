"""How the target's KV slots grow, written once for the engine that allocates them
(``cloud.kv_slots``, inside Triton) and the gateway that budgets them (``cloud.admission``).
Plain Python: the gateway never imports torch.

A slot starts at ``MIN_SLOT`` positions and doubles until what it must hold fits. The largest
block a session verifies at once is ``MAX_BLOCK`` drafts (Limits.max_draft_tokens).
"""

from __future__ import annotations

MIN_SLOT = 64  # a fresh slot's positions
MAX_BLOCK = 16  # draft tokens one verification may carry, and the largest hint


def slot_positions(length: int) -> int:
    """Positions a slot holds once it has grown to hold ``length``."""
    if length <= MIN_SLOT:
        return MIN_SLOT
    return MIN_SLOT << ((length - 1) // MIN_SLOT).bit_length()
