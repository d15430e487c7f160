"""One forward pass of a decoder-only LM over ragged segments of many sessions.

Each segment is one session's new tokens (a prefill chunk, a verification block of k + 1 tokens,
or one cloud-only token) appended to that session's KV slot. Every matrix multiply runs once over
all rows of all segments (this is where batching pays: the weights are read once per pass, not
once per session); only attention is per segment, against that session's own keys.

Logits are computed only for segments that ask for them: a prefill needs none (the cache holds
``committed[:-1]``), so a 30k-token prompt never materialises [L, V] logits.

Uses the Hugging Face model's own modules (norms, projections, MLP, rotary embedding), so weights,
biases and RoPE scaling are exactly the model's; the families and where they differ (sliding
windows, soft-capping, q/k norms, norms around attention and MLP) are ``cloud.engine.decoder``'s.
transformers' own forward stays the reference in tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specsplit.cloud.engine import decoder
from specsplit.cloud.engine.decoder import LayerSpec, check_supported
from specsplit.cloud.engine.kv_slots import KVSlots, Slot

__all__ = ["RaggedForward", "Segment", "logits_rows"]


@dataclass
class Segment:
    slot: Slot
    tokens: Sequence[int]
    want_logits: bool


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


def visible(start: int, n: int, lo: int, window: int | None, device) -> torch.Tensor:
    """[n, end - lo] bool: row i (position start + i) sees key position p iff p <= start + i
    and, with a window W, p > start + i - W (transformers' sliding window)."""
    keys = torch.arange(lo, start + n, device=device)[None, :]
    rows = torch.arange(start, start + n, device=device)[:, None]
    allowed = keys <= rows
    if window is not None:
        allowed &= keys > rows - window
    return allowed


def key_view(
    start: int, n: int, window: int | None, capped: bool, device
) -> tuple[int, torch.Tensor | None]:
    """(lo, mask) of a segment's rows at ``start``..``start + n - 1``: the first key position
    any of them may see, and which of the keys from there each sees (None where attention needs
    no mask: one row that sees every key, its scores not soft-capped)."""
    lo = 0 if window is None else max(0, start - window + 1)
    if n > 1 or lo > 0 or capped:
        return lo, visible(start, n, lo, window, device)
    return lo, None


@dataclass(frozen=True)
class _LayerParts:
    """A layer's modules the pass calls, looked up once (decoder): its norms, the names of its
    q/k/v projections, its per-head q/k norms (or None)."""

    norms: decoder.Norms
    qkv: tuple[str, ...]
    qk_norms: tuple[torch.nn.Module, torch.nn.Module] | None

    @classmethod
    def of(cls, layer) -> _LayerParts:
        return cls(decoder.norms(layer), decoder.projections(layer).qkv, decoder.qk_norms(layer))


class RaggedForward:
    def __init__(self, model: torch.nn.Module):
        config = model.config
        check_supported(config)
        self.config = config
        self.model = model
        self.inner = model.model
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = decoder.head_dim(config)
        self.specs = decoder.layer_specs(config)
        self.rotary = decoder.Rotary(self.inner, config)
        self.final_softcap = decoder.final_softcap(config)
        self.parts = [_LayerParts.of(layer) for layer in self.inner.layers]
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
        positions = [
            torch.arange(start, start + len(seg.tokens), device=device)
            for seg, start in zip(segments, starts, strict=True)
        ]
        x = self.inner.embed_tokens(ids)  # [R, hidden] (Gemma's module scales it)
        tables = self.rotary.tables(x, positions)
        # Each segment's keys and mask, per kind of layer: built once per pass, not per layer.
        views = {
            kind: [
                key_view(start, len(seg.tokens), *kind, device)
                for seg, start in zip(segments, starts, strict=True)
            ]
            for kind in {(spec.window, spec.softcap is not None) for spec in self.specs}
        }
        for li, layer in enumerate(self.inner.layers):
            norms = self.parts[li].norms
            attn = self._attention(li, layer, norms.pre_attn(x), tables, segments, starts, views)
            attn = layer.self_attn.o_proj(attn)
            x = x + (attn if norms.post_attn is None else norms.post_attn(attn))
            mlp = layer.mlp(norms.pre_mlp(x))
            x = x + (mlp if norms.post_mlp is None else norms.post_mlp(mlp))
        for seg, start in zip(segments, starts, strict=True):
            seg.slot.length = start + len(seg.tokens)
        return self._logits(x, segments)

    def _qkv(self, li: int, layer, h: torch.Tensor):
        rows, hd = h.shape[0], self.head_dim
        names = self.parts[li].qkv
        if len(names) == 1:  # fused (Phi-3)
            fused = layer.self_attn.qkv_proj(h)
            q, k, v = fused.split([self.heads * hd, self.kv_heads * hd, self.kv_heads * hd], -1)
        else:
            q, k, v = (getattr(layer.self_attn, n)(h) for n in names)
        q = q.view(rows, self.heads, hd)
        k, v = k.view(rows, self.kv_heads, hd), v.view(rows, self.kv_heads, hd)
        norms = self.parts[li].qk_norms
        if norms is not None:  # Qwen3, Gemma 3: per head, before the rotation
            q, k = norms[0](q), norms[1](k)
        return q, k, v

    def _attention(self, li, layer, h, tables, segments, starts, views) -> torch.Tensor:
        spec = self.specs[li]
        q, k, v = self._qkv(li, layer, h)
        cos, sin = tables[spec.rope]
        q, k = decoder.apply_rotary(q, cos, sin), decoder.apply_rotary(k, cos, sin)
        out = torch.empty_like(q)  # [R, heads, head_dim]
        offset = 0
        view = views[(spec.window, spec.softcap is not None)]
        for seg, start, (lo, mask) in zip(segments, starts, view, strict=True):
            n = len(seg.tokens)
            end = start + n
            kv = seg.slot.kv[li]  # [2, kv_heads, capacity, head_dim]
            kv[0, :, start:end] = k[offset : offset + n].transpose(0, 1)
            kv[1, :, start:end] = v[offset : offset + n].transpose(0, 1)
            o = _segment_attention(
                q[offset : offset + n].transpose(0, 1),  # [heads, n, head_dim]
                kv[0, :, lo:end],  # [kv_heads, end - lo, head_dim]
                kv[1, :, lo:end],
                mask,
                spec,
            )
            out[offset : offset + n] = o.transpose(0, 1)
            offset += n
        return out.reshape(h.shape[0], self.heads * self.head_dim)

    def _logits(self, x: torch.Tensor, segments) -> list[torch.Tensor | None]:
        def head(h):
            logits = self.model.lm_head(self.inner.norm(h))
            return decoder.soft_cap(logits, self.final_softcap)

        return logits_rows(x, segments, head)


def _segment_attention(q, keys, values, mask, spec: LayerSpec) -> torch.Tensor:
    """q [heads, n, hd], keys/values [kv_heads, L, hd], mask [n, L] bool or None ->
    [heads, n, hd]. Soft-capped scores (Gemma 2) go the eager way, as transformers does."""
    if spec.softcap is None:
        return F.scaled_dot_product_attention(
            q[None], keys[None], values[None], attn_mask=mask, scale=spec.scale, enable_gqa=True
        )[0]
    group = q.shape[0] // keys.shape[0]
    keys = keys.repeat_interleave(group, dim=0)
    values = values.repeat_interleave(group, dim=0)
    scores = decoder.soft_cap(q @ keys.transpose(1, 2) * spec.scale, spec.softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return probs @ values
