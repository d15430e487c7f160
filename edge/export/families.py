"""The decoder families the edge export supports, read from a Hugging Face config.json.

``read_spec(config, has_lm_head)`` returns a ``ModelSpec``: the shapes plus the few traits in
which the families part ways, so ``edge.export.onnx_graph`` builds every family with one layer loop.
Each trait mirrors transformers' modeling code for that family (``models/<family>/modeling_*``):

    family        qkv bias   q/k norm   norms                MLP           sliding windows
    llama         config     -          pre                  silu          -
    mistral       -          -          pre                  silu          every layer
    qwen2         q,k,v      -          pre                  silu          from max_window_layers
    qwen3         config     RMSNorm    pre                  silu          from max_window_layers
    gemma2        config     -          pre+post, (1 + w)    gelu (tanh)   alternating
    gemma3_text   config     (1 + w)    pre+post, (1 + w)    gelu (tanh)   5 of every 6 layers
    phi3          fused qkv  -          pre                  fused, silu   every layer

Gemma also scales the embedding by sqrt(hidden), scales attention by query_pre_attn_scalar,
soft-caps attention and final logits (Gemma 2), and gives Gemma 3's sliding layers their own
rotary base. Anything else (another model_type, an unsupported rotary scaling or activation,
bidirectional attention) is refused with a message that names it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specsplit.edge.export.rope import Rope, rope_for

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3")
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
_FULL, _SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class ModelSpec:
    family: str  # config.json's model_type
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_positions: int
    tied_embeddings: bool
    activation: str = "silu"  # "silu" or "gelu_tanh": act(gate) * up
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    fused_projections: bool = False  # Phi-3: qkv_proj and gate_up_proj weights
    qk_norm: bool = False  # RMSNorm of each q and k head before rotary (Qwen3, Gemma 3)
    gemma_norms: bool = False  # (1 + w) weights; norms after attention and MLP as well
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden)
    attn_scale: float = 0.0  # q.k multiplier; head_dim**-0.5 unless the family says otherwise
    attn_softcap: float | None = None  # Gemma 2: softcap * tanh(scores / softcap)
    final_softcap: float | None = None  # Gemma 2: the same on the logits
    windows: tuple[int | None, ...] = ()  # per layer: sliding window (keys it sees) or None
    rope_kinds: tuple[str, ...] = ()  # per layer: its key in ``ropes``
    ropes: dict[str, Rope] = field(default_factory=dict)

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads


def check_architecture(config: dict) -> None:
    family = config.get("model_type")
    if family == "gemma3":
        raise ValueError(
            "model_type 'gemma3' is Gemma 3's multimodal checkpoint; the edge export takes a "
            "text-only one (model_type 'gemma3_text', e.g. gemma-3-1b or gemma-3-270m)"
        )
    if family not in FAMILIES:
        raise ValueError(
            f"unsupported architecture {family!r}; the edge export supports {', '.join(FAMILIES)}"
        )
    if config.get("use_bidirectional_attention"):
        raise ValueError("bidirectional attention (an embedding model) cannot draft tokens")


# What transformers' config classes assume when config.json leaves a key out.
_DEFAULT_WINDOW = {"mistral": 4096, "qwen2": 4096, "qwen3": 4096, "gemma2": 4096}
_DEFAULT_WINDOW["gemma3_text"] = 4096
_SOFTCAPS = {"gemma2": (50.0, 30.0)}  # attention, final logits
_BIAS = {"qwen2": (True, False), "mistral": (False, False), "phi3": (False, False)}  # qkv, o


def _window(config: dict, family: str) -> int | None:
    return config.get("sliding_window", _DEFAULT_WINDOW.get(family))


def _layer_types(config: dict, family: str, layers: int) -> list[str]:
    """Which layers slide, as each family's config class decides it when layer_types is absent."""
    window = _window(config, family)
    if family in ("mistral", "phi3"):  # one window for every layer (layer_types ignored)
        return [_SLIDING if window else _FULL] * layers
    if family in ("qwen2", "qwen3"):
        if not config.get("use_sliding_window"):
            return [_FULL] * layers  # their window is off unless use_sliding_window
        first = config.get("max_window_layers", 28)
        types = config.get("layer_types")
        return types or [_SLIDING if i >= first else _FULL for i in range(layers)]
    if config.get("layer_types"):
        return list(config["layer_types"])
    if family in ("gemma2", "gemma3_text"):
        pattern = 2 if family == "gemma2" else config.get("sliding_window_pattern", 6)
        return [_SLIDING if (i + 1) % pattern else _FULL for i in range(layers)]
    return [_FULL] * layers


def _windows(config: dict, family: str, types: list[str]) -> tuple[int | None, ...]:
    window = _window(config, family)
    if any(t not in (_FULL, _SLIDING) for t in types):
        raise ValueError(f"unsupported layer types {sorted(set(types))}")
    return tuple(int(window) if t == _SLIDING and window else None for t in types)


def _ropes(config: dict, family: str, types: list[str], head_dim: int) -> tuple[tuple, dict]:
    if family == "gemma3_text":  # a rotary base per layer type
        kinds = tuple(types)
        return kinds, {kind: rope_for(config, kind, head_dim) for kind in set(kinds)}
    return ("rope",) * len(types), {"rope": rope_for(config, None, head_dim)}


def read_spec(config: dict, has_lm_head: bool) -> ModelSpec:
    """Validates a config.json (as a dict) and returns what the graph builder needs.
    ``has_lm_head``: the checkpoint holds ``lm_head.weight`` (decides tying when unsaid)."""
    check_architecture(config)
    family = config["model_type"]
    gemma = family.startswith("gemma")
    heads = config["num_attention_heads"]
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // heads
    layers = config["num_hidden_layers"]
    act_name = config.get("hidden_activation") or config.get("hidden_act", "silu")
    if act_name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {act_name!r}; need one of {list(ACTIVATIONS)}")
    tied = config.get("tie_word_embeddings", gemma or not has_lm_head)
    if not tied and not has_lm_head:
        raise ValueError("tie_word_embeddings is false but the checkpoint has no lm_head.weight")
    types = _layer_types(config, family, layers)
    rope_kinds, ropes = _ropes(config, family, types, head_dim)
    bias = bool(config.get("attention_bias", False))
    qkv_bias, o_bias = _BIAS.get(family, (bias, bias))
    attn_cap, final_cap = _SOFTCAPS.get(family, (None, None))
    return ModelSpec(
        family=family,
        vocab_size=config["vocab_size"],
        hidden_size=hidden,
        intermediate_size=config["intermediate_size"],
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        max_positions=config.get("max_position_embeddings", 32768),
        tied_embeddings=bool(tied),
        activation=ACTIVATIONS[act_name],
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=bool(config.get("mlp_bias", False)) and family == "llama",
        fused_projections=family == "phi3",
        qk_norm=family in ("qwen3", "gemma3_text"),
        gemma_norms=gemma,
        embed_scale=float(hidden**0.5) if gemma else None,
        attn_scale=float(config.get("query_pre_attn_scalar", 256) ** -0.5)
        if gemma
        else float(head_dim**-0.5),
        attn_softcap=config.get("attn_logit_softcapping", attn_cap) if gemma else None,
        final_softcap=config.get("final_logit_softcapping", final_cap) if gemma else None,
        windows=_windows(config, family, types),
        rope_kinds=rope_kinds,
        ropes=ropes,
    )
