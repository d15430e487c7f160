"""How the target's KV slots grow and what a position costs, written once for the engine that
allocates them (``cloud.engine.kv_slots``, inside Triton) and the gateway that budgets them
(``cloud.gateway.admission``), with the budget's default and the per-client share of it both
enforce. Plain Python: the gateway never imports torch.

A slot starts at ``MIN_SLOT`` positions and doubles until what it must hold fits. The largest
block a session verifies at once is ``MAX_DRAFT_TOKENS`` drafts (Limits.max_draft_tokens).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

MIN_SLOT = 64  # a fresh slot's positions
MAX_DRAFT_TOKENS = 16  # draft tokens one verification may carry, and the largest hint
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# The share of the KV memory one client's sessions may hold together by default: the gateway's
# quota (of its budget, or of the capacity the targets report) and the target's own (of its
# capacity, across every gateway), like the stream quota's quarter of the places.
KV_PER_CLIENT_SHARE = 0.25


def slot_positions(length: int) -> int:
    """Positions a slot holds once it has grown to hold ``length``."""
    if length <= MIN_SLOT:
        return MIN_SLOT
    return MIN_SLOT << ((length - 1) // MIN_SLOT).bit_length()


@dataclass(frozen=True)
class KVShape:
    """What one position of a session's KV slot costs: layers x 2 (K, V) x kv heads x head dim."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int

    @property
    def bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    @classmethod
    def from_dir(cls, model_dir: str | Path, dtype: str = "float32") -> KVShape:
        """From a Hugging Face config.json, at ``dtype``'s bytes a value (an unknown name, such
        as ``auto``, counts float32: the largest the target may choose)."""
        config = json.loads((Path(model_dir) / "config.json").read_text())
        text = config.get("text_config", config)  # multimodal configs nest the LM's
        heads = int(text["num_attention_heads"])
        head_dim = text.get("head_dim") or int(text["hidden_size"]) // heads
        return cls(
            layers=int(text["num_hidden_layers"]),
            kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            dtype_bytes=DTYPE_BYTES.get(dtype, 4),
        )


def default_budget_bytes(fraction: float = 0.5) -> int:
    """Half of this host's available memory: the target's KV on CPU lives in host memory next
    to its weights, which are loaded before the gateway starts."""
    pages = _meminfo_kib("MemAvailable")
    return int(pages * 1024 * fraction) if pages else 8 << 30


def _meminfo_kib(key: str) -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0
