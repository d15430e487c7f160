"""Tiny randomly initialised Qwen2 models, saved as Hugging Face directories (build/test time).

Same architecture as the real pair, small enough that tests and the overhead benchmark need no
download. ``init_range`` is
larger than the usual 0.02 so logits are peaked (no near-ties between ONNX Runtime and torch).
"""

from __future__ import annotations

from pathlib import Path


def make_tiny_qwen2(
    path: Path,
    seed: int,
    vocab_size: int = 256,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    init_range: float = 0.2,
    eos_token_id: int | None = None,
) -> Path:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        initializer_range=init_range,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    GenerationConfig(eos_token_id=eos_token_id, do_sample=False).save_pretrained(path)
    return path


def reference_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The target's own greedy output via transformers.generate (generated tokens only)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens if model.generation_config.eos_token_id is None else 0,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()
