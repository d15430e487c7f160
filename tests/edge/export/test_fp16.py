"""The float16 variants of the draft graph (precision "fp16" and "int4-fp16", made for the GPU
providers' fp16 kernels), run here on ONNX Runtime's CPU provider (it casts the float16 nodes it
has no kernel for): the same greedy tokens as their float32 counterparts, logits close.

What the CPU cannot show is their speed, nor their numbers on CUDA, DirectML or WebGPU, whose
fp16 kernels accumulate differently: not run here (no GPU).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from specsplit.edge.onnx_drafter import OnnxDrafter

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]
N = 24


def greedy(drafter: OnnxDrafter, n: int = N) -> tuple[list[int], np.ndarray]:
    """n greedy tokens after PROMPT, and the prompt's logits [len(PROMPT), vocab]."""
    logits = drafter.forward(PROMPT)
    prompt_logits = logits.copy()
    tokens = []
    for _ in range(n):
        tokens.append(int(np.argmax(logits[-1])))
        logits = drafter.forward([tokens[-1]])
    return tokens, prompt_logits


@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_fp16_greedy_equals_fp32(draft_exports, kind):
    tokens, logits = greedy(OnnxDrafter(draft_exports[kind, "fp16"], provider="cpu"))
    ref_tokens, ref_logits = greedy(OnnxDrafter(draft_exports[kind, "fp32"], provider="cpu"))
    assert tokens == ref_tokens
    assert np.abs(logits - ref_logits).max() < 1e-2 * np.abs(ref_logits).max()


def test_int4_fp16_logits_are_close_to_int4s(draft_exports):
    """The same 4-bit weights; on the CPU, int4's MatMulNBits also rounds its activations to
    int8 blocks (accuracy_level 4) where int4-fp16's computes in float16, so the two are
    different approximations whose greedy tokens may part where the tiny model's top two
    logits are close: compared by their logits."""
    _, logits = greedy(OnnxDrafter(draft_exports["tied", "int4-fp16"], provider="cpu"), 0)
    _, ref_logits = greedy(OnnxDrafter(draft_exports["tied", "int4"], provider="cpu"), 0)
    _, full = greedy(OnnxDrafter(draft_exports["tied", "fp32"], provider="cpu"), 0)
    scale = np.abs(full).max()
    assert np.abs(logits - ref_logits).max() < 5e-2 * scale
    # no further from the float32 graph than int4 itself is
    assert np.abs(logits - full).max() < 1.5 * np.abs(ref_logits - full).max()


def test_float16_weights_are_float16(draft_exports):
    """The Linears' weights and the embedding are stored in half (their bytes halve), so it is
    not the float32 graph by another name."""
    model = onnx.load(draft_exports["tied", "fp16"] / "model.onnx", load_external_data=False)
    types = {t.name: t.data_type for t in model.graph.initializer}
    halves = [n for n, t in types.items() if t == onnx.TensorProto.FLOAT16]
    assert any(n.endswith("qkv.weight_t") for n in halves)
    assert "embed_tokens.fp16" in halves and "lm_head.weight_t" in halves
    inputs = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
    assert inputs["past_key.0"] == onnx.TensorProto.FLOAT  # the KV cache contract is unchanged
