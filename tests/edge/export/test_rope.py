"""edge.export.rope against transformers' own rotary setup, for config.json files as the hub has
them (the older rope_theta + rope_scaling format) and as transformers 5 saves them
(rope_parameters)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specsplit.edge.export.rope import rope_for

LONG = [1.0 + 0.1 * i for i in range(48)]
SHORT = [1.0 + 0.01 * i for i in range(48)]
# (family, the config.json's keys as the hub's checkpoints write them, layer types to check)
CASES = {
    "llama-3.2": (
        "llama",
        dict(
            hidden_size=2048,
            num_attention_heads=32,
            max_position_embeddings=131072,
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=32.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            ),
        ),
        [None],
    ),
    "qwen2.5": ("qwen2", dict(hidden_size=896, num_attention_heads=14, rope_theta=1e6), [None]),
    "phi-3.5-mini": (
        "phi3",
        dict(
            hidden_size=3072,
            num_attention_heads=32,
            max_position_embeddings=131072,
            original_max_position_embeddings=4096,
            rope_scaling=dict(type="longrope", short_factor=SHORT, long_factor=LONG),
        ),
        [None],
    ),
    "phi-4-mini": (  # partial rotary: 96 of 128 dims
        "phi3",
        dict(
            hidden_size=3072,
            num_attention_heads=24,
            max_position_embeddings=131072,
            original_max_position_embeddings=4096,
            partial_rotary_factor=0.75,
            rope_theta=10000.0,
            rope_scaling=dict(type="longrope", short_factor=SHORT, long_factor=LONG),
        ),
        [None],
    ),
    "gemma-3": (  # linear scaling on global layers, a local base on sliding ones
        "gemma3_text",
        dict(
            hidden_size=1152,
            num_attention_heads=4,
            head_dim=256,
            rope_theta=1_000_000.0,
            rope_local_base_freq=10_000.0,
            rope_scaling=dict(rope_type="linear", factor=8.0),
        ),
        ["full_attention", "sliding_attention"],
    ),
}


ROTARY = {
    "llama": "llama.modeling_llama.LlamaRotaryEmbedding",
    "qwen2": "qwen2.modeling_qwen2.Qwen2RotaryEmbedding",
    "phi3": "phi3.modeling_phi3.Phi3RotaryEmbedding",
    "gemma3_text": "gemma3.modeling_gemma3.Gemma3RotaryEmbedding",
}


def _transformers(family: str, kwargs: dict, layer_type: str | None):
    """(inv_freq, attention scaling, long inv_freq or None, config) from the family's own
    rotary module, as its model builds it."""
    import importlib

    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.AutoConfig.for_model(family, **kwargs)
    module, name = ROTARY[family].rsplit(".", 1)
    rotary = getattr(importlib.import_module(f"transformers.models.{module}"), name)(config)
    prefix = f"{layer_type}_" if layer_type else ""
    inv = getattr(rotary, f"{prefix}inv_freq").numpy()
    scaling = getattr(rotary, f"{prefix}attention_scaling")
    params = config.rope_parameters[layer_type] if layer_type else config.rope_parameters
    long = None
    if params["rope_type"] == "longrope":  # what a call reaching the original length uses
        original = params["original_max_position_embeddings"]
        long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, None, seq_len=original + 1)
        long = long.numpy()
    return inv, scaling, long, config


@pytest.mark.parametrize("case", CASES)
def test_rope_matches_transformers_in_both_config_formats(case):
    family, kwargs, layer_types = CASES[case]
    for layer_type in layer_types:
        inv, scaling, long, config = _transformers(family, kwargs, layer_type)
        head_dim = (
            getattr(config, "head_dim", None)
            or kwargs["hidden_size"] // kwargs["num_attention_heads"]
        )
        old = {"model_type": family, "max_position_embeddings": 32768, **kwargs}
        new = json.loads(config.to_json_string())  # what save_pretrained writes
        for saved in (old, new):
            rope = rope_for(saved, layer_type, head_dim)
            np.testing.assert_allclose(rope.inv_freq, inv, rtol=1e-6)
            assert rope.rotary_dim == 2 * len(inv)
            assert rope.scaling == pytest.approx(scaling, rel=1e-7)
            if long is None:
                assert rope.long_inv_freq is None
            else:
                np.testing.assert_allclose(rope.long_inv_freq, long, rtol=1e-6)
                assert rope.long_from == kwargs["original_max_position_embeddings"]


def test_gemma3_local_layers_get_their_own_base():
    _, kwargs, _ = CASES["gemma-3"]
    config = {"model_type": "gemma3_text", "max_position_embeddings": 32768, **kwargs}
    full, local = (rope_for(config, t, 256) for t in ("full_attention", "sliding_attention"))
    assert full.inv_freq[1] == pytest.approx(1e6 ** (-2 / 256) / 8, rel=1e-6)  # linear x8
    assert local.inv_freq[1] == pytest.approx(1e4 ** (-2 / 256), rel=1e-6)


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic"])
def test_other_rope_scalings_are_refused_by_name(rope_type):
    config = {
        "model_type": "llama",
        "max_position_embeddings": 4096,
        "rope_scaling": {"rope_type": rope_type, "factor": 4.0},
    }
    with pytest.raises(ValueError, match=f"unsupported rope_type '{rope_type}'"):
        rope_for(config, None, 64)
