"""One forward pass of a decoder-only LM over ragged segments of many sessions.

Each segment is one session's new tokens (a prefill chunk, a verification block of k + 1 tokens,
or one cloud-only token) appended to that session's KV slot. Every matrix multiply runs once over
all rows of all segments (this is where batching pays: the weights are read once per pass, not
once per session); only attention is per segment, against that session's own keys.

Logits are computed only for segments that ask for them: a prefill needs none (the cache holds
``committed[:-1]``), so a 30k-token prompt never materialises [L, V] logits.

Uses the Hugging Face model's own modules (norms, projections, MLP, rotary embedding), so weights,
biases and RoPE scaling are exactly the model's; supports the Llama-style decoders (Qwen2, Llama,
Mistral without sliding windows). transformers' own forward stays the reference in tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specsplit.cloud.kv_slots import KVSlots, Slot

SUPPORTED = ("qwen2", "llama", "mistral")


@dataclass
class Segment:
    slot: Slot
    tokens: Sequence[int]
    want_logits: bool


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def check_supported(config) -> None:
    if config.model_type not in SUPPORTED:
        raise ValueError(
            f"batched target supports {', '.join(SUPPORTED)} models, not {config.model_type!r}"
        )
    if getattr(config, "use_sliding_window", False) or (
        config.model_type == "mistral" and getattr(config, "sliding_window", None)
    ):
        raise ValueError("sliding-window attention is not supported by the batched target")


def logits_rows(x: torch.Tensor, segments, head) -> list[torch.Tensor | None]:
    """``head`` (final norm + LM head) over the rows of the segments that want logits only."""
    keep, offset = [], 0
    for seg in segments:
        if seg.want_logits:
            keep.append(torch.arange(offset, offset + len(seg.tokens)))
        offset += len(seg.tokens)
    if not keep:
        return [None] * len(segments)
    logits = head(x[torch.cat(keep).to(x.device)])  # [kept rows, V]
    result, at = [], 0
    for seg in segments:
        if seg.want_logits:
            result.append(logits[at : at + len(seg.tokens)])
            at += len(seg.tokens)
        else:
            result.append(None)
    return result


class RaggedForward:
    def __init__(self, model: torch.nn.Module):
        config = model.config
        check_supported(config)
        self.config = config
        self.model = model
        self.inner = model.model
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.scale = self.head_dim**-0.5
        param = next(model.parameters())
        self.slots = KVSlots(
            len(self.inner.layers), self.kv_heads, self.head_dim, param.dtype, param.device
        )

    @torch.inference_mode()
    def __call__(self, segments: Sequence[Segment]) -> list[torch.Tensor | None]:
        """Appends every segment's tokens to its slot; returns logits [n, V] per segment that
        wants them (None otherwise). On an exception no slot's length changes."""
        device = self.slots.device
        starts = [seg.slot.length for seg in segments]
        for seg, start in zip(segments, starts, strict=True):
            self.slots.reserve(seg.slot, start + len(seg.tokens))
        ids = torch.tensor([t for seg in segments for t in seg.tokens], device=device)
        positions = torch.cat(
            [
                torch.arange(start, start + len(seg.tokens), device=device)
                for seg, start in zip(segments, starts, strict=True)
            ]
        )
        x = self.inner.embed_tokens(ids)  # [R, hidden]
        cos, sin = self.inner.rotary_emb(x[None], positions[None])  # [1, R, head_dim]
        cos, sin = cos[0][:, None], sin[0][:, None]  # [R, 1, head_dim]
        for li, layer in enumerate(self.inner.layers):
            h = layer.input_layernorm(x)
            attn = self._attention(li, layer.self_attn, h, cos, sin, segments, starts)
            x = x + layer.self_attn.o_proj(attn)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        for seg, start in zip(segments, starts, strict=True):
            seg.slot.length = start + len(seg.tokens)
        return self._logits(x, segments)

    def _attention(self, li, attn, h, cos, sin, segments, starts) -> torch.Tensor:
        rows = h.shape[0]
        q = attn.q_proj(h).view(rows, self.heads, self.head_dim)
        k = attn.k_proj(h).view(rows, self.kv_heads, self.head_dim)
        v = attn.v_proj(h).view(rows, self.kv_heads, self.head_dim)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = torch.empty_like(q)  # [R, heads, head_dim]
        offset = 0
        for seg, start in zip(segments, starts, strict=True):
            n = len(seg.tokens)
            end = start + n
            kv = seg.slot.kv[li]  # [2, kv_heads, capacity, head_dim]
            kv[0, :, start:end] = k[offset : offset + n].transpose(0, 1)
            kv[1, :, start:end] = v[offset : offset + n].transpose(0, 1)
            mask = None
            if n > 1:  # query i sits at position start + i and sees keys 0..start + i
                cols = torch.arange(end, device=h.device)
                rows_pos = torch.arange(start, end, device=h.device)
                mask = cols[None, :] <= rows_pos[:, None]  # [n, end]
            o = F.scaled_dot_product_attention(
                q[offset : offset + n].transpose(0, 1)[None],  # [1, heads, n, head_dim]
                kv[0, :, :end][None],  # [1, kv_heads, end, head_dim]
                kv[1, :, :end][None],
                attn_mask=mask,
                scale=self.scale,
                enable_gqa=True,
            )
            out[offset : offset + n] = o[0].transpose(0, 1)
            offset += n
        return out.reshape(rows, self.heads * self.head_dim)

    def _logits(self, x: torch.Tensor, segments) -> list[torch.Tensor | None]:
        return logits_rows(x, segments, lambda h: self.model.lm_head(self.inner.norm(h)))
