"""Rotary position embedding parameters from a Hugging Face config.json, as transformers reads them.

numpy only (a build step). ``rope_for(config, layer_type, head_dim)`` returns a ``Rope``: the
inverse frequencies of the rotated dims (partial rotary: the first ``rotary_dim`` of a head) and
what scales them. Supported ``rope_type``\\ s: ``default``, ``linear``, ``llama3`` (Llama 3.1+)
and ``longrope`` (Phi-3/3.5/4-mini, short and long factors); anything else is refused by name.

Both config.json formats are read: transformers 5's ``rope_parameters`` (flat, or nested by layer
type as Gemma 3 writes it) and the older ``rope_theta`` + ``rope_scaling`` (+ Gemma 3's
``rope_local_base_freq`` for its sliding layers). The arithmetic mirrors
``transformers.modeling_rope_utils`` in float32, step for step.

LongRoPE picks a table by sequence length; transformers picks one per forward call (the long
factors once the call's last position reaches ``original_max_position_embeddings``). Here each
position picks its own (long from that position on), which equals transformers for every
one-token step and for any call that stays on one side, and keeps a position's rotation
independent of how the tokens were split into calls (the cloud's target does the same).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

SUPPORTED = ("default", "linear", "llama3", "longrope")


@dataclass(frozen=True)
class Rope:
    inv_freq: tuple[float, ...]  # [rotary_dim / 2] float32 values
    rotary_dim: int  # leading dims of a head that rotate (head_dim unless partial)
    scaling: float = 1.0  # transformers' attention_scaling: multiplies cos and sin
    long_inv_freq: tuple[float, ...] | None = None  # longrope: positions >= long_from
    long_from: int = 0


def _get(mapping: dict, key: str, default):
    """``mapping[key]``, or ``default`` when it is missing or null (saved configs write nulls)."""
    value = mapping.get(key)
    return default if value is None else value


def _params(config: dict, layer_type: str | None) -> dict:
    """The rope parameter dict transformers would standardise for ``layer_type``."""
    gemma3 = config.get("model_type") == "gemma3_text"
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if isinstance(rope.get(layer_type), dict):  # nested by layer type (Gemma 3, new format)
        rope = dict(rope[layer_type])
    elif gemma3 and layer_type == "sliding_attention":  # old format: scaling is global-only
        rope = {"rope_theta": _get(config, "rope_local_base_freq", 10_000.0)}
    default_theta = 1_000_000.0 if gemma3 else 10_000.0
    rope["rope_theta"] = _get(rope, "rope_theta", _get(config, "rope_theta", default_theta))
    partial = _get(config, "partial_rotary_factor", 1.0)
    rope["partial_rotary_factor"] = _get(rope, "partial_rotary_factor", partial)
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if config.get("model_type") == "phi3" and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # as Phi3Config converts them
    rope["rope_type"] = rope_type
    if rope_type in ("llama3", "longrope"):
        # Phi-3 keeps the pretraining length at the top level; transformers prefers it there
        fallback = _get(rope, "original_max_position_embeddings", config["max_position_embeddings"])
        top = config.get("original_max_position_embeddings")
        rope["original_max_position_embeddings"] = top or fallback
    return rope


def rope_for(config: dict, layer_type: str | None, head_dim: int) -> Rope:
    """The rotary embedding of layers of ``layer_type`` (None: the model's one kind)."""
    p = _params(config, layer_type)
    rope_type = p["rope_type"]
    if rope_type not in SUPPORTED:
        raise ValueError(
            f"unsupported rope_type {rope_type!r}; the edge export supports {', '.join(SUPPORTED)}"
        )
    dim = int(head_dim * p["partial_rotary_factor"])
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    powers = np.float32(p["rope_theta"]) ** exponent  # [dim / 2]
    inv_freq = (np.float32(1.0) / powers).astype(np.float32)
    if rope_type == "linear":
        return Rope(_t(inv_freq / np.float32(p["factor"])), dim)
    if rope_type == "llama3":
        return Rope(_t(_llama3(inv_freq, p)), dim)
    if rope_type == "longrope":
        return _longrope(config, p, powers, dim)
    return Rope(_t(inv_freq), dim)


def _llama3(inv_freq: np.ndarray, p: dict) -> np.ndarray:
    """Llama 3.1's frequency-dependent scaling (modeling_rope_utils._compute_llama3_parameters)."""
    factor = p["factor"]
    low, high = p["low_freq_factor"], p["high_freq_factor"]
    old_context = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / np.float32(factor), inv_freq)
    smooth = (np.float32(old_context) / wavelen - np.float32(low)) / np.float32(high - low)
    smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _longrope(config: dict, p: dict, powers: np.ndarray, dim: int) -> Rope:
    """LongRoPE: inv_freq = 1 / (factor_i * theta^(2i/d)), short or long factors, and cos/sin
    scaled by sqrt(1 + ln(factor) / ln(original)) (modeling_rope_utils._compute_longrope_...)."""
    original = p["original_max_position_embeddings"]
    factor = p.get("factor") or config["max_position_embeddings"] / original
    scaling = p.get("attention_factor")
    if scaling is None:
        scaling = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    short, long = (np.asarray(p[k], dtype=np.float32) for k in ("short_factor", "long_factor"))
    if short.shape != (dim // 2,) or long.shape != (dim // 2,):
        raise ValueError(f"longrope factors need {dim // 2} values each")
    return Rope(
        inv_freq=_t(np.float32(1.0) / (short * powers)),
        rotary_dim=dim,
        scaling=float(scaling),
        long_inv_freq=_t(np.float32(1.0) / (long * powers)),
        long_from=int(original),
    )


def _t(values: np.ndarray) -> tuple[float, ...]:
    return tuple(float(v) for v in values.astype(np.float32))
