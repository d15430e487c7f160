"""A tiny but complete Qwen2 GGUF file, as llama.cpp's converter writes one: the metadata
transformers reads, a byte-level tokenizer with its end-of-sequence token, and every tensor, the
projections in the default target's Q4_K_M recipe (random blocks from
``tests.cloud.engine.test_gguf_weights``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2
SPECIAL = ("<|endoftext|>", "<|im_end|>")
VOCAB = 256  # 253 byte tokens, one merge, SPECIAL: a multiple of the kernels' row pairs


def _byte_tokens(n: int) -> list[str]:
    """GPT-2's printable stand-ins for bytes (its bytes_to_unicode), the first ``n``."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    extra = [b for b in range(256) if b not in keep]
    chars = {b: chr(b) for b in keep} | {b: chr(256 + i) for i, b in enumerate(extra)}
    return [chars[b] for b in range(256)][:n]


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    import gguf

    from tests.cloud.engine.test_gguf_weights import RECIPE, _raw

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_name("tiny-qwen2")
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_block_count(LAYERS)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    tokens = [*_byte_tokens(VOCAB - len(SPECIAL) - 1), "ab", *SPECIAL]  # one merge: a + b
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (VOCAB - len(SPECIAL)) + [3] * len(SPECIAL))
    writer.add_token_merges(["a b"])
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(False)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, LAYERS)
    kv = HIDDEN // HEADS * KV_HEADS
    shapes = {
        "self_attn.q_proj": (HIDDEN, HIDDEN),
        "self_attn.k_proj": (kv, HIDDEN),
        "self_attn.v_proj": (kv, HIDDEN),
        "self_attn.o_proj": (HIDDEN, HIDDEN),
        "mlp.gate_proj": (INTER, HIDDEN),
        "mlp.up_proj": (INTER, HIDDEN),
        "mlp.down_proj": (HIDDEN, INTER),
    }

    def quantised(hf_name: str, fmt: str, shape: tuple[int, int]) -> None:
        raw = _raw(fmt, *shape, rng)
        name = f"{names.get_name(hf_name)}.weight"
        writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[fmt.upper()])

    def plain(hf_name: str, suffix: str, values: np.ndarray) -> None:
        writer.add_tensor(f"{names.get_name(hf_name)}.{suffix}", values.astype(np.float32))

    quantised("model.embed_tokens", "q4_k", (VOCAB, HIDDEN))
    for i in range(LAYERS):
        layer = f"model.layers.{i}"
        plain(f"{layer}.input_layernorm", "weight", np.ones(HIDDEN))
        plain(f"{layer}.post_attention_layernorm", "weight", np.ones(HIDDEN))
        for proj, fmt in RECIPE.items():
            quantised(f"{layer}.{proj}", fmt, shapes[proj])
        for proj in ("q_proj", "k_proj", "v_proj"):
            rows = shapes[f"self_attn.{proj}"][0]
            plain(f"{layer}.self_attn.{proj}", "bias", rng.normal(0, 0.02, rows))
    plain("model.norm", "weight", np.ones(HIDDEN))
    quantised("lm_head", "q6_k", (VOCAB, HIDDEN))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
