"""GGUF -> Hugging Face safetensors directory (build step: torch and transformers).

Split from ``specsplit.shared.weights.sources`` so that fetching and verifying import without torch.
"""

from __future__ import annotations

from pathlib import Path

from specsplit.shared.weights.wheels import SourceError


def _load_dequantised(gguf: Path, dtype: object) -> object:
    """The GGUF as a transformers model in ``dtype``, for saving only (rotary buffers stay meta).

    ``from_pretrained(gguf_file=...)`` would do this, but in transformers 5.x it needs
    ``accelerate`` and leaves a GGUF quantizer attached that refuses ``save_pretrained``. For
    qwen2 it calls the same ``load_gguf_checkpoint`` (tensor names, dequantisation) as here.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config.dtype = dtype
    # A meta skeleton supplies names and shapes without initialising weights we overwrite.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors = load_gguf_checkpoint(
        str(gguf), return_tensors=True, model_to_load=model, torch_dtype=dtype
    )["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise SourceError(f"{gguf.name}: missing tensors {missing}, unexpected {unexpected}")
    return model


def convert(source, gguf: Path, out: Path, storage_dtype: str) -> dict[str, object]:
    """Dequantise ``gguf`` into an HF directory at ``out``; returns facts worth recording.
    ``source``: a ``GgufChunkSource``, or a ``shared.weights.local_gguf.LocalGguf``."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # A source that names no stopping tokens (a GGUF given by path) stops at the file's own.
    eos_tokens = source.eos_tokens or tuple(t for t in [tokenizer.eos_token] if t)
    if not eos_tokens:
        raise SourceError(f"{source.name}: the GGUF names no end-of-sequence token")
    pad_token = source.pad_token or tokenizer.pad_token or eos_tokens[-1]
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in eos_tokens]
    pad_id = tokenizer.convert_tokens_to_ids(pad_token)
    if None in eos_ids or pad_id is None or tokenizer.unk_token_id in [*eos_ids, pad_id]:
        raise SourceError(f"{source.name}: tokenizer lacks one of {eos_tokens}")
    if source.needs_chat_template and not tokenizer.chat_template:
        raise SourceError(f"{source.name}: the GGUF carried no tokenizer.chat_template")
    model = _load_dequantised(gguf, getattr(torch, storage_dtype))
    # GGUF stores one eos id (end of turn); generation must also stop at <|endoftext|>.
    # Only stopping tokens go in: specsplit passes its own sampling parameters.
    model.config.eos_token_id = eos_ids[0]
    model.config.pad_token_id = pad_id
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id, eos_token_id=eos_ids, pad_token_id=pad_id
    )
    model.save_pretrained(out)  # safetensors is the only format transformers 5.x writes
    tokenizer.save_pretrained(out)
    return {
        "vocab_size": model.config.vocab_size,
        "tokenizer_len": len(tokenizer),
        "eos_token_ids": eos_ids,
    }
