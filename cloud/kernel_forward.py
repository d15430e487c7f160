"""The ragged forward pass on our CPU kernels: quantised weights, batch-invariant rows.

Same contract as ``cloud.ragged.RaggedForward`` (segments in, logits per segment out, KV slots
with rollback by length), for the same Llama-style decoders, with:
- the projections in int8/int4 (``cloud.quantized``), the ones that read one input fused
  (q/k/v, gate/up), the LM head in int8;
- activations quantised to int8 per 32 values once per input, shared by the fused matmul;
- one attention call per layer for every segment of the pass (``cpu_kernels.attention``);
- RMSNorm fused into the quantisation of its output, the rotary embedding in place on the
  fused q/k/v output (both our kernels), the activation function in float32 torch.

Every op is row-wise: a row's logits depend on its own token and its own session's cache only,
never on how many rows or sessions share the pass (tests/cloud/test_kernel_forward.py proves it
bit for bit), so a verify block and one-token steps agree exactly in any precision.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import torch

from specsplit.cloud import cpu_kernels as kernels
from specsplit.cloud import quant_cache
from specsplit.cloud.huge_pages import copy_into_huge_pages
from specsplit.cloud.kv_slots import KVSlots
from specsplit.cloud.quantized import PROJECTIONS, QuantLinear, choose_bits, layer_projections
from specsplit.cloud.ragged import Segment, check_supported, logits_rows

log = logging.getLogger(__name__)

WEIGHTS = ("int8", "int4")


LINEARS = {  # fused linear -> (module, projections it reads)
    "qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "o": ("self_attn", ("o_proj",)),
    "gate_up": ("mlp", ("gate_proj", "up_proj")),
    "down": ("mlp", ("down_proj",)),
}


def quantize_layer(layer, weights: str, four_bit: bool) -> dict[str, QuantLinear]:
    bits = dict(
        zip(PROJECTIONS, choose_bits(layer_projections(layer), weights, four_bit), strict=True)
    )
    out = {}
    for name, (module, names) in LINEARS.items():
        linears = [getattr(getattr(layer, module), n) for n in names]
        out[name] = QuantLinear.quantize(linears, [bits[n] for n in names], four_bit)
    return out


def _pack_into_huge_pages(linears: list[QuantLinear]) -> None:
    """Puts the linears' weights in the kernel's layout, in one huge-page mapping
    (``cloud.huge_pages``), one linear at a time (peak memory: the packed copies + one)."""
    for lin in linears:
        lin.pack()
    tensors = [t for lin in linears for w in lin.kernel_parts for t in w.tensors]
    moved = iter(copy_into_huge_pages(tensors))
    for lin in linears:
        lin.kernel_parts = [
            dataclasses.replace(w, tensors=tuple(next(moved) for _ in w.tensors))
            for w in lin.kernel_parts
        ]


def _rms_norm(module) -> tuple[torch.Tensor, float]:
    """(weight, eps) of a Llama/Qwen2 RMSNorm, for the kernels' fused norm + quantisation."""
    eps = getattr(module, "variance_epsilon", None)
    if eps is None or not hasattr(module, "weight"):
        raise ValueError(f"{type(module).__name__} is not a Llama-style RMSNorm")
    return module.weight.detach().float().contiguous(), float(eps)


class _Layer:
    def __init__(self, layer, linears: dict[str, QuantLinear]):
        self.qkv, self.o = linears["qkv"], linears["o"]
        self.gate_up, self.down = linears["gate_up"], linears["down"]
        self.input_norm = _rms_norm(layer.input_layernorm)
        self.post_norm = _rms_norm(layer.post_attention_layernorm)
        self.act = layer.mlp.act_fn
        for module, names in LINEARS.values():  # the float weights are no longer needed
            for name in names:
                setattr(getattr(layer, module), name, None)

    @property
    def linears(self) -> list[QuantLinear]:
        return [self.qkv, self.o, self.gate_up, self.down]


class KernelForward:
    def __init__(
        self, model: torch.nn.Module, weights: str, four_bit: bool = False, cache_key: str = ""
    ):
        """``four_bit``: the model's projections already sit on 4-bit grids (``int4`` then
        keeps the others in int8; ``cloud.quantized.four_bit_source``). ``cache_key``: where
        the quantised weights are kept between loads (``cloud.quant_cache``); empty: not kept."""
        if weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
        self.config = config = model.config
        check_supported(config)
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        if self.head_dim % 16 or self.head_dim > kernels.MAX_HEAD_DIM:
            raise ValueError(f"head_dim {self.head_dim} does not suit the CPU kernels")
        self.scale = self.head_dim**-0.5
        inner = model.model
        state = quant_cache.load(cache_key) if cache_key else None
        if state is None:
            layers = [quantize_layer(layer, weights, four_bit) for layer in inner.layers]
            lm_head = QuantLinear.quantize([model.lm_head], [8])
            if cache_key:
                quant_cache.save(cache_key, layers, lm_head)
        else:
            layers, lm_head = state
        self.layers = [_Layer(layer, q) for layer, q in zip(inner.layers, layers, strict=True)]
        self.lm_head = lm_head
        _pack_into_huge_pages([lin for layer in self.layers for lin in layer.linears] + [lm_head])
        self.embed = inner.embed_tokens
        self.norm = _rms_norm(inner.norm)
        self.rotary = inner.rotary_emb.float()
        linears = [lin for layer in self.layers for lin in layer.linears]
        self.bytes = sum(lin.nbytes for lin in linears) + self.lm_head.nbytes
        parts = [bits for lin in linears for bits in lin.bits]
        log.info(
            "%s weights on the %s kernels: %d matmuls in int4, %d in int8 (4-bit source: %s), "
            "LM head int8, %.0f MB read per pass",
            weights,
            kernels.backend(),
            parts.count(4),
            parts.count(8),
            four_bit,
            self.bytes / 1e6,
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
        positions = torch.cat(
            [torch.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)]
        )
        x = self.embed(ids).float()  # [R, hidden]
        cos, sin = self.rotary(x[None], positions[None])
        cos, sin = cos[0].contiguous(), sin[0].contiguous()  # [R, head_dim]
        rows, hd = x.shape[0], self.head_dim
        q_width, kv_width = self.heads * hd, self.kv_heads * hd
        batch = kernels.RaggedBatch([seg.slot.kv for seg in segments], starts, lengths)
        for li, layer in enumerate(self.layers):
            qkv = layer.qkv(kernels.QuantizedRows(x, layer.input_norm)).contiguous()
            kernels.rope(qkv, self.heads + self.kv_heads, hd, cos, sin)  # q's and k's heads
            q, k, v = qkv.split([q_width, kv_width, kv_width], dim=-1)
            q = q.reshape(rows, self.heads, hd)
            k, v = k.reshape(rows, self.kv_heads, hd), v.reshape(rows, self.kv_heads, hd)
            attn = kernels.attention(q, k, v, batch, li, self.scale)
            x = x + layer.o(kernels.QuantizedRows(attn.reshape(rows, q_width)))
            gate, up = layer.gate_up(kernels.QuantizedRows(x, layer.post_norm)).chunk(2, dim=-1)
            x = x + layer.down(kernels.QuantizedRows(layer.act(gate) * up))
        for seg, start, n in zip(segments, starts, lengths, strict=True):
            seg.slot.length = start + n
        return logits_rows(x, segments, lambda h: self.lm_head(kernels.QuantizedRows(h, self.norm)))
