"""What the ONNX draft is checked against: transformers' own forward pass and greedy loop."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from specsplit.edge.onnx_drafter import OnnxDrafter

CPU = ["CPUExecutionProvider"]
PROMPT = [3, 17, 99, 5, 200, 41, 7, 128, 64]


@functools.cache
def _hf_model(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_logits(model_dir: Path, ids: list[int]) -> np.ndarray:
    """transformers' logits for the whole sequence in one pass, [len(ids), vocab]."""
    import torch

    with torch.no_grad():
        return _hf_model(model_dir)(torch.tensor([ids])).logits[0].numpy()


def drafter_greedy(drafter: OnnxDrafter, prompt: list[int], max_new_tokens: int) -> list[int]:
    drafter.reset()
    logits = drafter.forward(prompt)[-1]  # [vocab]
    out: list[int] = []
    for _ in range(max_new_tokens):
        token = int(logits.argmax())
        out.append(token)
        if token in drafter.eos_token_ids:
            break
        logits = drafter.forward([token])[-1]
    return out


def assert_logits_close(got: np.ndarray, ref: np.ndarray, rel: float = 1e-4) -> None:
    """Equal within ``rel`` of the largest logit (fp32 rounding, summed in another order)."""
    assert got.shape == ref.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, ref, rtol=0, atol=rel * max(1.0, np.abs(ref).max()))
