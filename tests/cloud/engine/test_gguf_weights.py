"""A target served from its GGUF's own blocks (``--weights gguf``): the file's values at the file's
widths, the same product on every kernel, rows independent of the batch, and a tensor that does
not match the model refused rather than served."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from specsplit.cloud.engine import formats, kernel_library
from specsplit.cloud.engine.ragged import Segment
from specsplit.cloud.engine.target import TargetModel
from tests.cloud.engine.passes import ragged_passes, stepped_alone

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not kernel_library.available(), reason="no CPU kernels here")

HIDDEN, INTER, VOCAB, LAYERS = 256, 512, 256, 2

# The Q4_K_M recipe of the default target: 4-bit K-quants, v / down / output in Q6_K.
RECIPE = {
    "self_attn.q_proj": "q4_k",
    "self_attn.k_proj": "q4_k",
    "self_attn.v_proj": "q6_k",
    "self_attn.o_proj": "q4_k",
    "mlp.gate_proj": "q4_k",
    "mlp.up_proj": "q4_k",
    "mlp.down_proj": "q6_k",
}


def _raw(fmt: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of ``fmt`` [n, bytes per row] with float16 scales small enough for a
    stable model."""
    qtype = gguf.GGMLQuantizationType[fmt.upper()]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    d = rng.uniform(2e-4, 6e-4, size=(n, k // block)).astype(np.float16)
    d = d.view(np.uint8).reshape(n, k // block, 2)
    if fmt == "q6_k":
        raw[..., size - 2 :] = d
    else:
        raw[..., 0:2] = d
        if fmt in ("q4_k", "q5_k"):
            raw[..., 2:4] = d
    return raw.reshape(n, -1)


def _dequantized(fmt: str, raw: np.ndarray) -> torch.Tensor:
    qtype = gguf.GGMLQuantizationType[fmt.upper()]
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, qtype)))


def _build(path, recipe: dict[str, str], spoil: str | None = None):
    """A tiny untied Qwen2 whose projections, LM head and embedding come from random GGUF
    blocks, saved with the GGUF beside it. ``spoil``: a GGUF tensor name whose rows in the file
    are shuffled, so that the file no longer matches the model there."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    rng = np.random.default_rng(1)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, LAYERS)
    writer = gguf.GGUFWriter(str(path / "model.gguf"), "qwen2")
    params = dict(model.named_parameters())
    todo = [(f"model.layers.{i}.{p}", f) for i in range(LAYERS) for p, f in recipe.items()]
    todo += [("lm_head", "q6_k"), ("model.embed_tokens", "q4_k")]
    for hf_name, fmt in todo:
        weight = params[f"{hf_name}.weight"]
        raw = _raw(fmt, *weight.shape, rng)
        with torch.no_grad():
            weight.copy_(_dequantized(fmt, raw))
        name = f"{names.get_name(hf_name)}.weight"
        if name == spoil:
            raw = raw[rng.permutation(raw.shape[0])]
        writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[fmt.upper()])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("gguf"), RECIPE)


def test_each_tensor_is_served_at_the_files_width_and_values(gguf_dir):
    target = TargetModel(gguf_dir, device="cpu", calibrate=False, weights="gguf")
    forward = target.forward
    used = [fmt for layer in forward.layers for lin in layer.linears for fmt in lin.formats]
    assert set(used) == {"q4_k", "q6_k"} and forward.lm_head.formats == ["q6_k"]
    assert forward.embed_rows is not None  # the embedding too, from its Q4_K blocks
    # the bytes a one-row pass reads are the file's (all but the embedding), within 5%
    from specsplit.cloud.engine.gguf_weights import GgufWeights

    file_bytes = GgufWeights(gguf_dir / "model.gguf", target.config).file_bytes
    assert abs(forward.bytes / file_bytes - 1) < 0.05, (forward.bytes, file_bytes)


def test_logits_follow_the_float_model_of_the_files_values(gguf_dir):
    """The served product is int8 activations against the file's weights: close to the float
    model holding the same (dequantised) weights, and the same greedy token almost always."""
    from transformers import AutoModelForCausalLM

    target = TargetModel(gguf_dir, device="cpu", calibrate=False, weights="gguf")
    reference = AutoModelForCausalLM.from_pretrained(gguf_dir, dtype=torch.float32).eval()
    seq = np.random.default_rng(2).integers(0, VOCAB, size=24).tolist()
    slot = target.forward.slots.open(1)
    got = target.forward([Segment(slot, seq, True)])[0]
    with torch.no_grad():
        want = reference(torch.tensor([seq])).logits[0]
    err = (got - want).norm() / want.norm()
    assert err < 0.1, err  # int8 activations alone (int8 weights from the copy: ~0.27)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


def test_rows_are_bitwise_the_same_alone_and_batched(gguf_dir):
    forward = TargetModel(gguf_dir, device="cpu", calibrate=False, weights="gguf").forward
    rng = np.random.default_rng(4)
    sequences = [rng.integers(0, VOCAB, size=n).tolist() for n in (30, 3, 17)]
    batched = ragged_passes(forward, sequences, rng, max_rows=6)
    for sid, seq in enumerate(sequences):
        assert torch.equal(batched[sid], stepped_alone(forward, seq, sid=50 + sid))


def test_every_kernel_answers_the_same(gguf_dir, monkeypatch):
    """The canonical product on every kernel this CPU runs: the same logits bit for bit."""
    seq = list(range(1, 12))
    logits = []
    for kernel in kernel_library.supported_backends():
        monkeypatch.setenv(kernel_library.BACKEND_ENV, kernel)
        kernel_library.backend.cache_clear()
        forward = TargetModel(gguf_dir, device="cpu", calibrate=False, weights="gguf").forward
        assert forward.layers[0].qkv.kernel_parts[0].backend == kernel
        slot = forward.slots.open(1)
        logits.append(forward([Segment(slot, seq, True)])[0])
    kernel_library.backend.cache_clear()
    assert all(torch.equal(x, logits[0]) for x in logits[1:])


def test_a_tensor_that_differs_from_the_model_is_refused_and_served_from_the_copy(tmp_path, caplog):
    spoilt = _build(tmp_path, RECIPE, spoil="blk.1.ffn_up.weight")
    with caplog.at_level(logging.WARNING):
        forward = TargetModel(spoilt, device="cpu", calibrate=False, weights="gguf").forward
    assert "blk.1.ffn_up.weight: its values differ" in caplog.text
    # gate (q4_k, from the file) and up (int8, from the float copy) of layer 1
    assert forward.layers[1].gate_up.formats == ["q4_k", "int8"]
    assert forward.layers[0].gate_up.formats == ["q4_k"]


def test_gguf_weights_need_a_gguf_source(tmp_path):
    from specsplit.shared.tiny import make_tiny_qwen2

    plain = make_tiny_qwen2(tmp_path / "plain", seed=1, hidden_size=64)
    with pytest.raises(ValueError, match="--weights gguf serves a GGUF source"):
        TargetModel(plain, device="cpu", calibrate=False, weights="gguf")


def test_formats_dequantize_as_gguf_does():
    rng = np.random.default_rng(5)
    for fmt in formats.gguf_formats():
        raw = _raw(fmt, 32, 512, rng)
        got = formats.dequantize(fmt, formats.from_gguf(fmt, raw))
        assert torch.equal(got, _dequantized(fmt, raw).float()), fmt


# Every GGUF format at once, mixed inside the fused linears (as the draft's Q4_K_M file mixes
# Q5_0, Q8_0, Q4_K and Q6_K).
MIXED = {
    "self_attn.q_proj": "q5_0",
    "self_attn.k_proj": "q8_0",
    "self_attn.v_proj": "q4_0",
    "self_attn.o_proj": "q5_k",
    "mlp.gate_proj": "q4_k",
    "mlp.up_proj": "q8_0",
    "mlp.down_proj": "q6_k",
}


def test_every_format_mixed_in_one_model_is_batch_invariant(tmp_path):
    mixed = _build(tmp_path, MIXED)
    forward = TargetModel(mixed, device="cpu", calibrate=False, weights="gguf").forward
    assert forward.layers[0].qkv.formats == ["q5_0", "q8_0", "q4_0"]
    assert forward.layers[0].gate_up.formats == ["q4_k", "q8_0"]
    rng = np.random.default_rng(6)
    sequences = [rng.integers(0, VOCAB, size=n).tolist() for n in (20, 9)]
    batched = ragged_passes(forward, sequences, rng, max_rows=5)
    for sid, seq in enumerate(sequences):
        assert torch.equal(batched[sid], stepped_alone(forward, seq, sid=70 + sid))
