"""What differs between the decoder families the target serves, read once from a Hugging Face
model: the engines (``cloud.engine.ragged`` in torch, ``cloud.engine.kernel_forward`` on our CPU
kernels) run one layer loop for all of them and ask this module where the families part ways.

Families: Llama (incl. Llama 3 rope scaling), Mistral (sliding window), Qwen2/2.5 (qkv bias,
optional sliding layers), Qwen3 (per-head q/k norms), Gemma 2 (scaled embeddings, (1 + w)
norms around attention and MLP, attention and final logit soft-capping, alternating sliding
layers, GeGLU), Gemma 3 text (q/k norms, a local rope base for its sliding layers) and Phi-3 /
3.5 / 4-mini (fused qkv and gate_up projections, LongRoPE, partial rotary). Norms, projections,
activations and rotary tables stay the model's own modules, so weights and scalings are exactly
the model's; only attention (with its window, soft-cap and scale) is the engines' own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED = ("qwen2", "llama", "mistral", "qwen3", "gemma2", "gemma3_text", "phi3")
DYNAMIC_ROPE = ("longrope", "dynamic")  # tables that depend on the sequence's length


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer's attention: the window it sees (None: all of the past), the
    soft-cap of its scores (None: none), their scale, and the rotary table it uses (a layer
    type for models with one per type, else None)."""

    window: int | None
    softcap: float | None
    scale: float
    rope: str | None


@dataclass(frozen=True)
class Projections:
    """Module and attribute names of a layer's projections, fused as the engines run them:
    q/k/v (one fused linear, or three), o, gate/up (one or two), down."""

    qkv: tuple[str, ...]
    gate_up: tuple[str, ...]

    @property
    def all(self) -> tuple[str, ...]:
        return (*self.qkv, "o_proj", *self.gate_up, "down_proj")


def check_supported(config) -> None:
    if config.model_type not in SUPPORTED:
        raise ValueError(
            f"the target supports {', '.join(SUPPORTED)} models, not {config.model_type!r}"
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("bidirectional attention is not a causal decoder's")


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _window(config, i: int) -> int | None:
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if types is not None:  # Qwen2/3 and Gemma name each layer's kind
        return window if types[i] == "sliding_attention" else None
    return window or None  # Mistral, Phi-3: every layer, when set


def layer_specs(config) -> list[LayerSpec]:
    scalar = getattr(config, "query_pre_attn_scalar", None)  # Gemma's attention scale
    scale = (scalar if scalar else head_dim(config)) ** -0.5
    softcap = getattr(config, "attn_logit_softcapping", None) or None
    params = getattr(config, "rope_parameters", None) or {}
    per_type = config.model_type == "gemma3_text" and "full_attention" in params
    types = getattr(config, "layer_types", None)
    return [
        LayerSpec(_window(config, i), softcap, scale, types[i] if per_type else None)
        for i in range(config.num_hidden_layers)
    ]


def projections(layer) -> Projections:
    attn, mlp = layer.self_attn, layer.mlp
    qkv = ("qkv_proj",) if hasattr(attn, "qkv_proj") else ("q_proj", "k_proj", "v_proj")
    gate_up = ("gate_up_proj",) if hasattr(mlp, "gate_up_proj") else ("gate_proj", "up_proj")
    return Projections(qkv, gate_up)


ATTENTION_PROJECTIONS = ("qkv_proj", "q_proj", "k_proj", "v_proj", "o_proj")


def owner(layer, name: str) -> torch.nn.Module:
    """The module that holds projection ``name``: attention's or the MLP."""
    return layer.self_attn if name in ATTENTION_PROJECTIONS else layer.mlp


def projection(layer, name: str) -> torch.nn.Module:
    return getattr(owner(layer, name), name)


@dataclass(frozen=True)
class Norms:
    """A layer's norms: before attention; on attention's output (Gemma); before the MLP; on
    the MLP's output (Gemma). Llama-style layers call their pre-MLP norm
    ``post_attention_layernorm``; Gemma's of that name normalises attention's output."""

    pre_attn: torch.nn.Module
    post_attn: torch.nn.Module | None
    pre_mlp: torch.nn.Module
    post_mlp: torch.nn.Module | None


def norms(layer) -> Norms:
    if hasattr(layer, "pre_feedforward_layernorm"):
        return Norms(
            layer.input_layernorm,
            layer.post_attention_layernorm,
            layer.pre_feedforward_layernorm,
            layer.post_feedforward_layernorm,
        )
    return Norms(layer.input_layernorm, None, layer.post_attention_layernorm, None)


def unit_offset(config) -> bool:
    """Whether the family's RMSNorms scale by (1 + w) rather than w (Gemma's)."""
    return config.model_type.startswith("gemma")


def rms_norm_params(module, config) -> tuple[torch.Tensor, float]:
    """(effective weight float32, eps) of an RMSNorm: y = weight * x / sqrt(mean(x^2) + eps)."""
    eps = getattr(module, "variance_epsilon", None)
    if eps is None:
        eps = getattr(module, "eps", None)
    if eps is None or getattr(module, "weight", None) is None:
        raise ValueError(f"{type(module).__name__} is not an RMSNorm")
    weight = module.weight.detach().float()
    if unit_offset(config):
        weight = 1.0 + weight
    return weight.contiguous(), float(eps)


def qk_norms(layer) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    attn = layer.self_attn
    if hasattr(attn, "q_norm") and hasattr(attn, "k_norm"):
        return attn.q_norm, attn.k_norm
    return None


def mlp_activation(layer):
    mlp = layer.mlp
    return getattr(mlp, "act_fn", None) or mlp.activation_fn


def final_softcap(config) -> float | None:
    return getattr(config, "final_logit_softcapping", None) or None


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    return x if cap is None else torch.tanh(x / cap) * cap


class Rotary:
    """cos/sin per row for each rotary table the layers use, from the model's own rotary
    module. A table that depends on the sequence's length (LongRoPE's short or long factors,
    dynamic NTK) is computed for each row from its own position, as a one-token step at that
    position computes it: so a verify block's rows are those of one-row steps, and a session's
    rows never depend on the other rows of a pass (transformers instead picks one table per
    call from the call's longest position, which a batch would make depend on its company)."""

    def __init__(self, inner, config):
        self.module = inner.rotary_emb
        params = getattr(config, "rope_parameters", None) or {}
        kinds = [p.get("rope_type", "default") for p in params.values() if isinstance(p, dict)]
        kinds.append(params.get("rope_type", "default"))
        self.dynamic = any(k in DYNAMIC_ROPE for k in kinds)
        self.keys = sorted({s.rope for s in layer_specs(config)}, key=str)

    def tables(
        self, x: torch.Tensor, positions: list[torch.Tensor]
    ) -> dict[str | None, tuple[torch.Tensor, torch.Tensor]]:
        """{rope key: (cos [R, rot_dim], sin [R, rot_dim])} in x's dtype; ``positions``: one
        tensor per segment, in row order."""
        rows = torch.cat(positions)
        parts = list(rows.split(1)) if self.dynamic else [rows]
        out = {}
        for key in self.keys:
            cs = [self._one(x, p, key) for p in parts]
            out[key] = (torch.cat([c for c, _ in cs]), torch.cat([s for _, s in cs]))
        return out

    def _one(self, x, positions, key):
        args = (x[None], positions[None]) + ((key,) if key is not None else ())
        cos, sin = self.module(*args)
        return cos[0], sin[0]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [R, heads, head_dim], cos/sin [R, rot_dim]: the first rot_dim dims rotated ("rotate
    half" within them), the rest passed through (partial rotary, as Phi-4-mini)."""
    cos, sin = cos[:, None], sin[:, None]
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    head, tail = x[..., :rot], x[..., rot:]
    return torch.cat([head * cos + rotate_half(head) * sin, tail], dim=-1)
