"""The ragged forward pass on our CPU kernels: quantised weights, batch-invariant rows.

Same contract as ``cloud.engine.ragged.RaggedForward`` (segments in, logits per segment out, KV
slots with rollback by length), for the same Llama-style decoders, with:
- the projections in int8/int4 (``cloud.engine.quantized``), the ones that read one input fused
  (q/k/v, gate/up), the LM head in int8;
- activations quantised to int8 per 32 values once per input, shared by the fused matmul;
- one attention call per layer for every segment of the pass (``cpu_kernels.attention``);
- RMSNorm fused into the quantisation of its output, the rotary embedding in place on the
  fused q/k/v output, the MLP activation act(gate) * up fused into its quantisation;
- every float op between two kernels in C too (``cpu_kernels.rms_norm``, ``residual_add``,
  ``soft_cap``: ``cpu_rowwise.c``), none in torch: torch splits elementwise ops and reductions
  where the element and thread counts say, so its results for a row can move with the batch.
  What torch still does between kernels only copies values (cat, split, the rotary tables'
  gather), or is one IEEE add per element (a projection's bias), whose result does not depend
  on how the elements are split; the rotary tables are computed one position at a time
  (``PositionTables``).

Every op is row-wise: a row's logits depend on its own token and its own session's cache only,
never on how many rows or sessions share the pass nor on the thread count
(tests/cloud/engine/test_kernel_forward.py and tests/cloud/engine/test_rowwise.py prove it bit
for bit, the latter at the real widths), so a verify block and one-token steps agree exactly in
any precision.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch

from specsplit.cloud.engine import cpu_kernels as kernels
from specsplit.cloud.engine import decoder, kernel_library, quant_cache
from specsplit.cloud.engine.decoder import check_supported
from specsplit.cloud.engine.gguf_weights import Embedding, GgufWeights
from specsplit.cloud.engine.huge_pages import copy_into_huge_pages, release_freed_memory
from specsplit.cloud.engine.kv_slots import KVSlots
from specsplit.cloud.engine.quantized import (
    QuantLinear,
    choose_bits,
    fused_bias,
    layer_projections,
    quantize_float,
)
from specsplit.cloud.engine.ragged import Segment, logits_rows

log = logging.getLogger(__name__)

WEIGHTS = ("int8", "int4", "gguf")


def _groups(layer) -> dict[str, tuple[str, ...]]:
    """Fused linear -> the projections it reads (a family's own fused ones, Phi-3's, as is)."""
    names = decoder.projections(layer)
    return {"qkv": names.qkv, "o": ("o_proj",), "gate_up": names.gate_up, "down": ("down_proj",)}


def quantize_layer(
    layer, weights: str, four_bit: bool, gguf: GgufWeights | None = None, prefix: str = ""
) -> dict[str, QuantLinear]:
    """The layer's fused linears. ``gguf``: serve each projection the file holds in a kernel
    format from its blocks (``prefix`` + projection path is its HF name); the others, and all
    of them without a file, quantised from the float copy (int8, or int4 per ``choose_bits``)."""
    names = decoder.projections(layer).all
    linears = layer_projections(layer)
    if gguf is None:
        bits = dict(zip(names, choose_bits(linears, weights, four_bit), strict=True))
    else:
        bits = dict.fromkeys(names, 8)  # a float tensor of a GGUF: int8, never coarser
    out = {}
    for fused, members in _groups(layer).items():
        parts = []
        for name in members:
            lin = decoder.projection(layer, name)
            path = _path_in(layer, lin)
            got = None if gguf is None else gguf.weight(prefix + path, lin.weight.detach())
            if got is None:
                got = (f"int{bits[name]}", quantize_float(lin.weight, bits[name], four_bit))
            parts.append(got)
        linears_ = [decoder.projection(layer, n) for n in members]
        out[fused] = QuantLinear.fuse(parts, fused_bias(linears_))
    return out


def _path_in(layer, linear) -> str:
    """The dotted path of ``linear`` inside ``layer`` (e.g. ``self_attn.q_proj``)."""
    return next(name for name, m in layer.named_modules() if m is linear)


def _lm_head(model, gguf: GgufWeights | None) -> QuantLinear:
    """The LM head: the file's ``output`` (or, tied, its token embedding), else int8."""
    weight = model.lm_head.weight.detach()
    got = None
    if gguf is not None:
        got = gguf.weight("lm_head", weight)
        if got is None and getattr(model.config, "tie_word_embeddings", False):
            got = gguf.weight("model.embed_tokens", weight)
    if got is None:
        got = ("int8", quantize_float(weight, 8))
    return QuantLinear.fuse([got])


def _expected(model, weights: str) -> quant_cache.Expected:
    """The shapes a kept entry of ``model``'s quantised weights must have (quant_cache.check)."""

    def shape(layer, members: tuple[str, ...]) -> tuple[int, int]:
        linears = [decoder.projection(layer, n) for n in members]
        return sum(lin.out_features for lin in linears), linears[0].in_features

    layers = tuple(
        {fused: shape(layer, members) for fused, members in _groups(layer).items()}
        for layer in model.model.layers
    )
    head = model.lm_head
    return quant_cache.Expected(layers, (head.out_features, head.in_features), weights)


def _pack_into_huge_pages(linears: list[QuantLinear]) -> None:
    """Puts the linears' weights in the kernel's layout, in one huge-page mapping
    (``cloud.engine.huge_pages``), one linear at a time (peak memory: the packed copies + one)."""
    for lin in linears:
        lin.pack()
    tensors = [t for lin in linears for w in lin.kernel_parts for t in w.tensors]
    moved = iter(copy_into_huge_pages(tensors))
    for lin in linears:
        lin.kernel_parts = [
            dataclasses.replace(w, tensors=tuple(next(moved) for _ in w.tensors))
            for w in lin.kernel_parts
        ]
    del tensors, moved  # the packed copies outside the mapping: freed, handed back
    release_freed_memory()


def _embedding(gguf: GgufWeights | None, module) -> Embedding | None:
    """The token embedding served from the GGUF's blocks, if the file holds it in a kernel
    format equal to the model's copy."""
    if gguf is None:
        return None
    t = gguf.tensor("model.embed_tokens")
    if t is None or t.raw.shape[0] != module.weight.shape[0]:
        return None
    if not gguf.matches(t, module.weight.detach(), None):
        gguf.refused.append(f"{t.name}: its values differ from the model's")
        return None
    return Embedding(t)


def _release_float_weights(model, drop_embedding: bool) -> None:
    """Lets go of the float weights the kernels do not read (the projections, the LM head, and
    the embedding where the GGUF serves it), copies the few that
    stay (norms, biases, the embedding otherwise) out of the weight file's mapping, and hands
    the freed memory back to the system: the loader's tensors are views of one mapping of the
    whole file, whose pages count in the process's memory until the last view is gone."""
    for layer in model.model.layers:
        for members in _groups(layer).values():
            for name in members:
                setattr(decoder.owner(layer, name), name, None)
    model.lm_head.weight = None
    if drop_embedding:
        model.model.embed_tokens.weight = None
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                module._parameters[name] = torch.nn.Parameter(
                    param.detach().clone(), requires_grad=False
                )
    gc.collect()
    release_freed_memory()


class PositionTables:
    """The rotary cos/sin of each position, computed the first time a pass reaches it and kept,
    so that a position's table is a function of the position only, never of the other rows of
    a pass (torch's cos and sin over a pass split their work where the pass's size says).
    Computed by ``decoder.Rotary.tables`` over a fixed block of positions, ``BLOCK`` of them
    from a multiple of ``BLOCK`` (each position always in the same call, at the same place), or
    one position alone where the tables depend on the sequence's length (``Rotary.dynamic``)."""

    BLOCK = 64

    def __init__(self, rotary: decoder.Rotary, hidden: int):
        self.rotary = rotary
        self.probe = torch.zeros(1, hidden)  # tells the module the dtype (float32) and device
        self.known = 0  # positions 0 .. known - 1 are kept
        self.cos: dict[str | None, torch.Tensor] = {}  # {key: [capacity, rotary dims]}
        self.sin: dict[str | None, torch.Tensor] = {}

    @torch.inference_mode()  # the kept tables are inference tensors: written in this mode only
    def __call__(self, positions: torch.Tensor) -> dict[str | None, tuple[torch.Tensor, ...]]:
        """{rope key: (cos [R, rotary dims], sin [R, rotary dims])} for positions [R]."""
        top = int(positions.max()) + 1 if len(positions) else 0
        if top > self.known:
            self._extend(top)
        return {k: (self.cos[k][positions], self.sin[k][positions]) for k in self.cos}

    def _extend(self, top: int) -> None:
        step = 1 if self.rotary.dynamic else self.BLOCK
        end = -(-top // step) * step
        capacity = max(end, 2 * self.known)
        for start in range(self.known, end, step):
            one = self.rotary.tables(self.probe, [torch.arange(start, start + step)])
            for key, (cos, sin) in one.items():
                if key not in self.cos or self.cos[key].shape[0] < start + step:
                    self.cos[key] = _grown(self.cos.get(key), capacity, cos.shape[-1])
                    self.sin[key] = _grown(self.sin.get(key), capacity, sin.shape[-1])
                self.cos[key][start : start + step] = cos
                self.sin[key][start : start + step] = sin
        self.known = end


def _grown(table: torch.Tensor | None, rows: int, width: int) -> torch.Tensor:
    out = torch.empty(rows, width, dtype=torch.float32)
    if table is not None:
        out[: table.shape[0]] = table
    return out


class _Layer:
    def __init__(self, layer, linears: dict[str, QuantLinear], config):
        self.qkv, self.o = linears["qkv"], linears["o"]
        self.gate_up, self.down = linears["gate_up"], linears["down"]
        norms = decoder.norms(layer)
        params = lambda m: None if m is None else decoder.rms_norm_params(m, config)  # noqa: E731
        self.input_norm, self.post_attn_norm = params(norms.pre_attn), params(norms.post_attn)
        self.pre_mlp_norm, self.post_mlp_norm = params(norms.pre_mlp), params(norms.post_mlp)
        qk = decoder.qk_norms(layer)
        self.qk_norms = None if qk is None else (params(qk[0]), params(qk[1]))
        self.act = kernels.activation_kind(decoder.mlp_activation(layer))  # refused here

    @property
    def linears(self) -> list[QuantLinear]:
        return [self.qkv, self.o, self.gate_up, self.down]


class KernelForward:
    def __init__(
        self,
        model: torch.nn.Module,
        weights: str,
        four_bit: bool = False,
        cache_key: str = "",
        gguf_path: str | Path | None = None,
    ):
        """``weights``: ``gguf`` serves the projections, LM head and embedding from the GGUF at
        ``gguf_path`` at its own widths (``cloud.engine.gguf_weights``); ``int8``/``int4``
        quantise the float copy. ``four_bit``: the model's projections already sit on 4-bit
        grids (``int4`` then keeps the others in int8; ``quantized.four_bit_source``).
        ``cache_key``: where the quantised weights are kept between loads
        (``cloud.engine.quant_cache``); empty: not kept."""
        if weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
        self.config = config = model.config
        check_supported(config)
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = decoder.head_dim(config)
        if self.head_dim % 16:  # the attention and rotary kernels go 16 values at a time
            raise ValueError(f"head_dim {self.head_dim} does not suit the CPU kernels")
        self.specs = decoder.layer_specs(config)
        self.final_softcap = decoder.final_softcap(config)
        inner = model.model
        gguf = None
        if weights == "gguf":
            if gguf_path is None:
                raise ValueError("weights 'gguf' need the model's GGUF file")
            gguf = GgufWeights(gguf_path, config)
        expected = _expected(model, weights)
        state = quant_cache.load(cache_key, expected) if cache_key else None
        if state is None:
            layers = [
                quantize_layer(layer, weights, four_bit, gguf, f"model.layers.{i}.")
                for i, layer in enumerate(inner.layers)
            ]
            lm_head = _lm_head(model, gguf)
            if cache_key:
                quant_cache.save(cache_key, layers, lm_head)
        else:
            layers, lm_head = state
        self.embed_rows = _embedding(gguf, inner.embed_tokens)
        _release_float_weights(model, drop_embedding=self.embed_rows is not None)
        self.layers = [
            _Layer(layer, q, config) for layer, q in zip(inner.layers, layers, strict=True)
        ]
        self.lm_head = lm_head
        self.embed = inner.embed_tokens
        self.norm = decoder.rms_norm_params(inner.norm, config)
        inner.rotary_emb.float()  # tables in float32; the embedding keeps its dtype (_embed)
        self.tables = PositionTables(decoder.Rotary(inner, config), config.hidden_size)
        _pack_into_huge_pages([lin for layer in self.layers for lin in layer.linears] + [lm_head])
        linears = [lin for layer in self.layers for lin in layer.linears] + [self.lm_head]
        self.bytes = sum(lin.nbytes for lin in linears)
        used = Counter(fmt for lin in linears for fmt in lin.formats)
        source = ""
        if gguf is not None:
            source = f"; the GGUF's tensors: {gguf.file_bytes / 1e6:.0f} MB"
            for why in gguf.refused:
                log.warning("served from the float copy: %s", why)
        log.info(
            "%s weights on the %s kernels, matmuls by format %s (4-bit source: %s): "
            "%.0f MB read per one-row pass%s",
            weights,
            kernel_library.backend(),
            dict(used),
            four_bit,
            self.bytes / 1e6,
            source,
        )
        self.slots = KVSlots(
            len(self.layers), self.kv_heads, self.head_dim, torch.float32, torch.device("cpu")
        )

    @torch.inference_mode()
    def __call__(self, segments: Sequence[Segment]) -> list[torch.Tensor | None]:
        starts = [seg.slot.length for seg in segments]
        lengths = [len(seg.tokens) for seg in segments]
        for seg, start, n in zip(segments, starts, lengths, strict=True):
            self.slots.reserve(seg.slot, start + n)
        ids = torch.tensor([t for seg in segments for t in seg.tokens])
        positions = [torch.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)]
        x = self._embed(ids)  # [R, hidden] float32
        tables = self.tables(torch.cat(positions))  # {key: (cos, sin) [R, rotary dims]}
        batch = kernels.RaggedBatch([seg.slot.kv for seg in segments], starts, lengths)
        for li, layer in enumerate(self.layers):
            x = self._layer(li, layer, x, tables, batch)
        for seg, start, n in zip(segments, starts, lengths, strict=True):
            seg.slot.length = start + n
        return logits_rows(x, segments, self._head)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows in float32, as the module upcast to float32 would give them
        (the lookup is exact; Gemma's module scales by its embed_scale), without holding a
        float32 copy of the whole table; from the GGUF's blocks where it has them."""
        if self.embed_rows is not None:
            x = self.embed_rows(ids)
        else:
            x = torch.nn.functional.embedding(ids, self.embed.weight).float()
        scale = getattr(self.embed, "embed_scale", None)
        return x if scale is None else x * scale.float()

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(kernels.QuantizedRows(h, self.norm))
        return kernels.soft_cap(logits, self.final_softcap)

    def _layer(self, li: int, layer: _Layer, x, tables, batch) -> torch.Tensor:
        spec, rows, hd = self.specs[li], x.shape[0], self.head_dim
        q_width, kv_width = self.heads * hd, self.kv_heads * hd
        qkv = layer.qkv(kernels.QuantizedRows(x, layer.input_norm)).contiguous()
        if layer.qk_norms is not None:  # Qwen3, Gemma 3: per head, before the rotation
            q, k = qkv[:, :q_width], qkv[:, q_width : q_width + kv_width]
            kernels.rms_norm(q, layer.qk_norms[0], out=q)
            kernels.rms_norm(k, layer.qk_norms[1], out=k)
        cos, sin = tables[spec.rope]
        kernels.rope(qkv, self.heads + self.kv_heads, hd, cos, sin)  # q's and k's heads
        q, k, v = qkv.split([q_width, kv_width, kv_width], dim=-1)
        q = q.reshape(rows, self.heads, hd)
        k, v = k.reshape(rows, self.kv_heads, hd), v.reshape(rows, self.kv_heads, hd)
        attn = kernels.attention(q, k, v, batch, li, spec.scale, spec.window, spec.softcap)
        out = layer.o(kernels.QuantizedRows(attn.reshape(rows, q_width)))
        x = kernels.residual_add(x, out, layer.post_attn_norm, in_place=True)  # the pass owns x
        gate_up = layer.gate_up(kernels.QuantizedRows(x, layer.pre_mlp_norm))  # [R, 2F]
        out = layer.down(kernels.ActivatedRows(gate_up, layer.act))
        return kernels.residual_add(x, out, layer.post_mlp_norm, in_place=True)
