"""edge.export.families.read_spec on config.json files as the hub's popular drafts ship them (older
transformers formats: rope_theta + rope_scaling, no layer_types): the traits it reads."""

from __future__ import annotations

import pytest

from specsplit.edge.export.families import read_spec

FACTORS = [1.0] * 48
CONFIGS = {  # the keys that matter, as in each model's config.json
    "Llama-3.2-1B": dict(
        model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
        max_position_embeddings=131072, rms_norm_eps=1e-5, attention_bias=False, mlp_bias=False,
        rope_theta=500000.0, tie_word_embeddings=True, hidden_act="silu",
        rope_scaling=dict(factor=32.0, high_freq_factor=4.0, low_freq_factor=1.0,
                          original_max_position_embeddings=8192, rope_type="llama3"),
    ),
    "Qwen2.5-0.5B": dict(
        model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, rope_theta=1e6,
        max_position_embeddings=32768, sliding_window=32768, use_sliding_window=False,
        max_window_layers=21, tie_word_embeddings=True, hidden_act="silu",
    ),
    "Qwen3-0.6B": dict(
        model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, rope_theta=1000000, rope_scaling=None,
        sliding_window=None, use_sliding_window=False, attention_bias=False,
        tie_word_embeddings=True, hidden_act="silu",
    ),
    "Mistral-7B-v0.1": dict(
        model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, rope_theta=10000.0,
        max_position_embeddings=32768, sliding_window=4096, tie_word_embeddings=False,
    ),
    "gemma-2-2b": dict(
        model_type="gemma2", hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, vocab_size=256000,
        max_position_embeddings=8192, query_pre_attn_scalar=256, sliding_window=4096,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, rope_theta=10000.0,
        hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
    ),
    "gemma-3-1b": dict(
        model_type="gemma3_text", hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
        max_position_embeddings=32768, query_pre_attn_scalar=256, sliding_window=512,
        sliding_window_pattern=6, rope_theta=1000000, rope_local_base_freq=10000,
        rope_scaling=None, attn_logit_softcapping=None, final_logit_softcapping=None,
        hidden_activation="gelu_pytorch_tanh",
    ),
    "Phi-3-mini-4k": dict(
        model_type="phi3", hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, vocab_size=32064,
        max_position_embeddings=4096, original_max_position_embeddings=4096,
        sliding_window=2047, rope_scaling=None, rope_theta=10000.0, hidden_act="silu",
        tie_word_embeddings=False,
    ),
    "Phi-4-mini": dict(
        model_type="phi3", hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
        num_attention_heads=24, num_key_value_heads=8, vocab_size=200064,
        max_position_embeddings=131072, original_max_position_embeddings=4096,
        partial_rotary_factor=0.75, sliding_window=262144, rope_theta=10000.0,
        rope_scaling=dict(type="longrope", short_factor=FACTORS, long_factor=FACTORS),
        hidden_act="silu", tie_word_embeddings=True,
    ),
}  # fmt: skip


def spec(name: str):
    return read_spec(CONFIGS[name], has_lm_head=not CONFIGS[name].get("tie_word_embeddings"))


def test_llama_3():
    s = spec("Llama-3.2-1B")
    assert (s.head_dim, s.group, s.tied_embeddings, s.qkv_bias, s.o_bias) == (64, 4, True, 0, 0)
    assert set(s.windows) == {None} and s.ropes["rope"].inv_freq[-1] < 1e-5 / 32  # llama3


def test_qwen2_and_qwen3():
    q2, q3 = spec("Qwen2.5-0.5B"), spec("Qwen3-0.6B")
    assert set(q2.windows) == {None}  # use_sliding_window false: no window at all
    assert (q2.qkv_bias, q2.o_bias, q2.qk_norm) == (True, False, False)
    assert (q3.qkv_bias, q3.qk_norm, q3.head_dim) == (False, True, 128)


def test_mistral_slides_on_every_layer():
    assert spec("Mistral-7B-v0.1").windows == (4096,) * 32


def test_gemma_2():
    s = spec("gemma-2-2b")
    assert s.windows[:4] == (4096, None, 4096, None)  # sliding first, then global
    assert (s.attn_softcap, s.final_softcap, s.attn_scale) == (50.0, 30.0, 1 / 16)
    assert (s.gemma_norms, s.activation, s.tied_embeddings) == (True, "gelu_tanh", True)
    assert s.embed_scale == pytest.approx(2304**0.5)


def test_gemma_3():
    s = spec("gemma-3-1b")
    assert s.windows[:6] == (512,) * 5 + (None,)  # five sliding layers, one global
    assert s.rope_kinds[:6] == ("sliding_attention",) * 5 + ("full_attention",)
    local, full = s.ropes["sliding_attention"], s.ropes["full_attention"]
    assert local.inv_freq[1] > full.inv_freq[1]  # base 10,000 against 1,000,000
    assert (s.qk_norm, s.attn_softcap, s.final_softcap) == (True, None, None)


def test_phi_3_and_4():
    mini = spec("Phi-3-mini-4k")
    assert mini.windows == (2047,) * 32 and mini.fused_projections
    assert mini.ropes["rope"].long_inv_freq is None and mini.ropes["rope"].rotary_dim == 96
    phi4 = spec("Phi-4-mini")
    rope = phi4.ropes["rope"]
    assert (rope.rotary_dim, rope.long_from, phi4.head_dim) == (96, 4096, 128)  # partial
    assert rope.scaling == pytest.approx((1 + 3.4657359 / 8.3177662) ** 0.5)  # ln 32 / ln 4096


def test_what_stays_unsupported_is_refused_by_name():
    with pytest.raises(ValueError, match="activation 'relu'"):
        read_spec({**CONFIGS["Llama-3.2-1B"], "hidden_act": "relu"}, has_lm_head=True)
    with pytest.raises(ValueError, match="no lm_head.weight"):
        read_spec({**CONFIGS["Mistral-7B-v0.1"]}, has_lm_head=False)
    with pytest.raises(ValueError, match="layer types"):
        read_spec({**CONFIGS["gemma-2-2b"], "layer_types": ["chunked_attention"] * 26}, True)
