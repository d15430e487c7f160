"""Tiny randomly initialised checkpoints of every decoder family the target serves, for tests.

Each is built with transformers' own config and model classes (as its own tests build theirs),
small enough to run in milliseconds, and shaped so every family trait matters: sliding windows
shorter than the test sequences, norms with random weights (not ones), soft-caps low enough to
bite, a rotary scaling of each kind. Test-only: imports torch and transformers.
"""

from __future__ import annotations

from pathlib import Path

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3")
WINDOW = 6  # tokens a sliding-window layer sees: shorter than every test sequence


def _configs(family: str) -> tuple[type, type, dict]:
    import transformers as tf

    common = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=family.startswith("gemma"),
    )
    alternate = ["sliding_attention", "full_attention"] * 2
    by_family = {
        "llama": (
            tf.LlamaConfig,
            tf.LlamaForCausalLM,
            dict(
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
                attention_bias=False,
            ),
        ),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM, dict(sliding_window=WINDOW)),
        "qwen2": (
            tf.Qwen2Config,
            tf.Qwen2ForCausalLM,
            dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2),
        ),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(head_dim=32)),
        "gemma2": (
            tf.Gemma2Config,
            tf.Gemma2ForCausalLM,
            dict(
                head_dim=32,
                sliding_window=WINDOW,
                query_pre_attn_scalar=24,
                attn_logit_softcapping=2.0,
                final_logit_softcapping=4.0,
                layer_types=alternate,
            ),
        ),
        "gemma3_text": (
            tf.Gemma3TextConfig,
            tf.Gemma3ForCausalLM,
            dict(
                head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=24, layer_types=alternate
            ),
        ),
        "phi3": (
            tf.Phi3Config,
            tf.Phi3ForCausalLM,
            dict(
                num_attention_heads=2,  # head_dim 32: 16 rotary dims, as the CPU kernels need
                num_key_value_heads=1,
                # LongRoPE's long factors from position 16 on: the test sequences cross it (the
                # top-level field overrides the one inside rope_scaling)
                original_max_position_embeddings=16,
                sliding_window=WINDOW,
                partial_rotary_factor=0.5,
                rope_scaling={
                    "rope_type": "longrope",
                    "short_factor": [1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7],  # rotary dims / 2
                    "long_factor": [2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 5.5],
                    "original_max_position_embeddings": 16,
                },
            ),
        ),
    }
    config_cls, model_cls, extra = by_family[family]
    return config_cls, model_cls, {**common, **extra}  # extra's keys win


def make_tiny(family: str, path: Path, seed: int = 0) -> Path:
    """A tiny ``family`` checkpoint saved at ``path`` (safetensors, float32)."""
    import torch
    from transformers import GenerationConfig

    config_cls, model_cls, kwargs = _configs(family)
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # ones (or zeros for Gemma's 1 + w) would hide a wrong norm
                p.copy_(
                    torch.rand(p.shape, generator=gen) * 0.8 + (0.0 if "gemma" in family else 0.6)
                )
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    GenerationConfig(eos_token_id=None, do_sample=False).save_pretrained(path)
    return path


def _one_token_steps(model):
    """A function feeding transformers one token at its position, with one cache across calls
    (what its one-token steps compute); returns that position's logits [vocab]."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)

    def step(token: int, position: int):
        with torch.no_grad():
            out = model(
                torch.tensor([[token]]),
                position_ids=torch.tensor([[position]]),
                cache=cache,
                use_cache=True,
            )
        return out.logits[0, -1]

    return step


def stepwise_logits(model, seq: list[int]):
    """transformers' logits [len(seq), vocab] for positions 0..len-1, one token per call with
    its cache: what its one-token steps compute. (A length-dependent rotary table, Phi-3's
    LongRoPE, is picked per call: per position here, as both of our engines pick it; a single
    call over the whole sequence would pick the long factors for every position.)"""
    import torch

    step = _one_token_steps(model)
    return torch.stack([step(token, i) for i, token in enumerate(seq)])


def stepwise_greedy(model, prompt: list[int], n: int) -> list[int]:
    """``prompt`` + n greedy tokens from one-token steps, as ``stepwise_logits`` (generate()
    agrees with them but for Phi-3 past LongRoPE's switch, where it picks other factors than
    its one-token forward)."""
    step = _one_token_steps(model)
    seq = list(prompt)
    for i, token in enumerate(prompt[:-1]):
        step(token, i)
    for _ in range(n):
        seq.append(int(step(seq[-1], len(seq) - 1).argmax()))
    return seq
