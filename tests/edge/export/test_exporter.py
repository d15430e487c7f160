"""The ONNX export: its graph, metadata and weight formats, on tiny random Qwen2 checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from specsplit.edge.export.exporter import export_onnx
from specsplit.edge.onnx_drafter import OnnxDrafter
from specsplit.shared.tiny import make_tiny_qwen2
from tests.edge.reference import CPU, PROMPT, drafter_greedy
from tests.shared.test_tokenizer_fingerprint import save as save_tokenizer


@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_int8_mostly_agrees_with_fp32(draft_exports, kind):
    fp32 = OnnxDrafter(draft_exports[kind, "fp32"], providers=CPU)
    int8 = OnnxDrafter(draft_exports[kind, "int8"], providers=CPU)
    assert int8.precision == "int8"
    # teacher-forced on the fp32 greedy continuation, so one early flip does not decide it all
    ids = PROMPT + drafter_greedy(fp32, PROMPT, 32)
    fp32.reset()
    agree = (fp32.forward(ids, True).argmax(-1) == int8.forward(ids, True).argmax(-1)).mean()
    assert agree >= 0.8, agree  # 0.93 and 0.95 seen; block-wise weight-only int8
    assert len(drafter_greedy(int8, PROMPT, 8)) == 8


def on_4bit_grids(src: Path, dst: Path) -> Path:
    """A copy of a tiny checkpoint whose projections sit on the 4-bit grids the int4 export
    uses (quantised and dequantised once): its int4 export then carries these very weights."""
    import torch
    from safetensors.torch import load_file, save_file

    from specsplit.edge.export.exporter import QuantOptions
    from specsplit.edge.export.onnx_quant import block_for, quantize_blocks_4bit

    shutil.copytree(src, dst)
    (path,) = dst.glob("*.safetensors")
    state = load_file(path)
    for name, w in state.items():
        if name.endswith("proj.weight"):
            block = block_for(w.shape[1], QuantOptions().block)  # the export's
            packed, scales, zeros = quantize_blocks_4bit(w.float().numpy(), block)
            n, blocks = packed.shape[:2]
            q = np.stack([packed & 15, packed >> 4], axis=-1).reshape(n, blocks, -1)
            z = np.stack([zeros & 15, zeros >> 4], axis=-1).reshape(n, -1)[:, :blocks]
            back = scales.reshape(n, blocks, 1) * (q.astype(np.float32) - z[..., None])
            state[name] = torch.from_numpy(back.reshape(w.shape).astype(np.float32))
    save_file(state, path, metadata={"format": "pt"})
    return dst


def test_int4_graph_computes_its_weights(qwen_dirs, tmp_path):
    """The int4 graph (MatMulNBits 4-bit, packed levels and zero points) computes the model its
    weights stand for: on a checkpoint already on its grids, int4 logits follow fp32's, the
    only difference being int8 activations inside MatMulNBits and the int8 LM head."""
    grid = on_4bit_grids(qwen_dirs["tied"], tmp_path / "grid")
    fp32 = OnnxDrafter(export_onnx(grid, tmp_path / "fp32", precision="fp32"), providers=CPU)
    int4 = OnnxDrafter(export_onnx(grid, tmp_path / "int4", precision="int4"), providers=CPU)
    assert int4.precision == "int4"
    ids = PROMPT + drafter_greedy(fp32, PROMPT, 24)
    fp32.reset()
    ref, got = fp32.forward(ids, all_logits=True), int4.forward(ids, all_logits=True)
    err = np.linalg.norm(got - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
    assert err.max() < 0.1, err  # a wrong nibble or zero point errs by ~100%
    assert len(drafter_greedy(int4, PROMPT, 8)) == 8


def test_int4_blocks_reproduce_a_4bit_grid_exactly():
    """Weights that sit on a 4-bit grid with an integer zero point (what the quantiser can
    represent) come back exactly; others within half a step of their block's grid."""
    from specsplit.edge.export.onnx_quant import quantize_blocks_4bit

    rng = np.random.default_rng(3)
    levels = rng.integers(0, 16, size=(8, 4, 32)).astype(np.float32)
    levels[..., 0], levels[..., 1] = 0, 15  # every block spans its whole grid
    zero = rng.integers(0, 16, size=(8, 4, 1)).astype(np.float32)
    scale = rng.uniform(0.001, 0.01, size=(8, 4, 1)).astype(np.float32)
    w = (scale * (levels - zero)).reshape(8, 128)
    packed, scales, zeros = quantize_blocks_4bit(w, 32)
    q = np.stack([packed & 15, packed >> 4], axis=-1).reshape(8, 4, 32).astype(np.float32)
    z = np.stack([zeros & 15, zeros >> 4], axis=-1).reshape(8, -1)[:, :4, None]
    back = (scales.reshape(8, 4, 1) * (q - z)).reshape(8, 128)
    np.testing.assert_allclose(back, w, rtol=0, atol=1e-6)
    noisy = rng.standard_normal((8, 128)).astype(np.float32)
    packed, scales, zeros = quantize_blocks_4bit(noisy, 32)
    q = np.stack([packed & 15, packed >> 4], axis=-1).reshape(8, 4, 32).astype(np.float32)
    z = np.stack([zeros & 15, zeros >> 4], axis=-1).reshape(8, -1)[:, :4, None]
    back = (scales.reshape(8, 4, 1) * (q - z)).reshape(8, 128)
    assert (
        np.abs(back - noisy).reshape(8, 4, 32) <= scales.reshape(8, 4, 1) * 0.5 + 1e-6
    ).mean() > 0.97


def test_quantised_exports_are_smaller(draft_exports):
    def size(d: Path) -> int:
        return sum(f.stat().st_size for f in d.iterdir())

    fp32 = size(draft_exports["untied", "fp32"])
    assert size(draft_exports["untied", "int8"]) < 0.6 * fp32
    assert size(draft_exports["untied", "int4"]) < size(draft_exports["untied", "int8"])


def test_graph_io_names_and_shapes(draft_exports):
    model = onnx.load(draft_exports["tied", "fp32"] / "model.onnx", load_external_data=False)

    def dims(value_info) -> list:
        return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]

    inputs = {v.name: dims(v) for v in model.graph.input}
    outputs = {v.name: dims(v) for v in model.graph.output}
    assert inputs["input_ids"] == [1, "seq_len"] and inputs["past_len"] == [1]
    assert inputs["logits_from"] == [1]  # the LM head runs from there: a prefill's last only
    assert outputs["logits"] == [1, "logits_len", 256]
    for i in range(2):  # kv_heads 2, head_dim 16; past and present are one buffer
        for kind in ("key", "value"):
            assert inputs[f"past_{kind}.{i}"] == [1, 2, "capacity", 16]
            assert outputs[f"present_{kind}.{i}"] == [1, 2, "capacity", 16]
    assert len(inputs) == 3 + 2 * 2 and len(outputs) == 1 + 2 * 2
    assert {n.op_type for n in model.graph.node} >= {"TensorScatter", "RotaryEmbedding"}
    assert "Concat" not in {n.op_type for n in model.graph.node}  # no copy of the past
    assert (draft_exports["tied", "fp32"] / "model.onnx.data").exists()


def test_metadata_and_copied_files(tmp_path):
    src = make_tiny_qwen2(tmp_path / "hf", seed=3, eos_token_id=7)
    save_tokenizer(src / "tokenizer.json")
    out = export_onnx(src, tmp_path / "onnx")
    meta = json.loads((out / "specsplit_draft.json").read_text())
    expected = {"vocab_size": 256, "num_layers": 2, "num_kv_heads": 2, "head_dim": 16}
    assert {k: meta[k] for k in expected} == expected
    assert (meta["precision"], meta["eos_token_ids"], meta["architecture"]) == (
        "fp32",
        [7],
        "qwen2",
    )
    assert (meta["format"], meta["graph_format"], meta["source"]["name"]) == (1, 5, "hf")
    for name in ("tokenizer.json", "config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    assert OnnxDrafter(out, providers=CPU).eos_token_ids == (7,)
    assert meta["tokenizer_fingerprint"].startswith("v1:")
    (src / "tokenizer.json").write_text("{}")  # unreadable: the edge could not tokenize either
    with pytest.raises(ValueError, match="tokenizer.json: the tokenizers package cannot read it"):
        export_onnx(src, tmp_path / "again")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"model_type": "gpt2"}, "unsupported architecture 'gpt2'.*llama, mistral, qwen2"),
        ({"model_type": "gemma3"}, "multimodal.*gemma3_text"),
        ({"model_type": "gemma3_text", "use_bidirectional_attention": True}, "bidirectional"),
    ],
)
def test_unsupported_model_types_are_refused_by_name(tmp_path, config, message):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        export_onnx(src, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no output, no temp dirs


def test_unsupported_precision_raises(tmp_path, qwen_dirs):
    with pytest.raises(ValueError, match="precision"):
        export_onnx(qwen_dirs["tied"], tmp_path / "out", precision="int3")
    assert list(tmp_path.iterdir()) == []


def test_failed_export_keeps_previous_output(tmp_path, qwen_dirs):
    out = tmp_path / "out"
    export_onnx(qwen_dirs["tied"], out)
    before = (out / "model.onnx").read_bytes()
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_bytes((qwen_dirs["tied"] / "config.json").read_bytes())
    (broken / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(KeyError):
        export_onnx(broken, out)
    assert (out / "model.onnx").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken", "out"]


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_a_split_lm_head_adds_the_other_ids_once_the_sequence_holds_one(
    qwen_dirs, draft_exports, tmp_path, precision
):
    """An LM head split after the lowest ids (plus EOS and added tokens): over text of those ids
    the kept ids' logits are the whole head's and every other id is -inf (never proposed, q = 0);
    while the sequence's last RARE_WINDOW tokens hold another id, every id's logits are the
    whole head's; rolled back before that id, or RARE_WINDOW tokens past it, the kept rows
    alone again."""
    from specsplit.edge.onnx_drafter import RARE_WINDOW

    full = OnnxDrafter(draft_exports["tied", precision], providers=CPU)
    out = export_onnx(qwen_dirs["tied"], tmp_path / "part", precision=precision, head_vocab=100)
    part = OnnxDrafter(out, providers=CPU)
    kept = np.load(out / "lm_head_ids.npy")
    assert kept.tolist()[:100] == list(range(100)) and set(part.eos_token_ids) <= set(kept)
    others = np.setdiff1d(np.arange(part.vocab_size), kept)
    frequent = [t for t in PROMPT if t in kept]
    assert 0 < len(frequent) < len(PROMPT)  # PROMPT holds others (200, 128)

    def close(got, ref, ids):
        np.testing.assert_allclose(got[:, ids], ref[:, ids], rtol=0, atol=1e-4)

    ref, got = full.forward(frequent, all_logits=True), part.forward(frequent, all_logits=True)
    assert got.shape == ref.shape
    close(got, ref, kept)
    assert np.isneginf(got[:, others]).all()
    assert all(t in kept for t in drafter_greedy(part, frequent, 16))
    part.reset(), full.reset()
    part.forward(frequent), full.forward(frequent)
    rare = [200, 5, 7]  # another id, then frequent ones: the rest stays on after it
    ref, got = full.forward(rare, all_logits=True), part.forward(rare, all_logits=True)
    close(got, ref, np.arange(part.vocab_size))
    close(part.forward([3]), full.forward([3]), np.arange(part.vocab_size))
    part.truncate(len(frequent)), full.truncate(len(frequent))
    ref, got = full.forward([5]), part.forward([5])
    close(got, ref, kept)
    assert np.isneginf(got[:, others]).all()
    part.forward([200, *[5] * (RARE_WINDOW - 2)])
    assert not np.isneginf(part.forward([5])[:, others]).any()  # 200: the window's first
    assert np.isneginf(part.forward([5])[:, others]).all()  # past the window
    # a prompt holding others from the start: every id at once, in a prefill and in a step
    part.reset(), full.reset()
    close(part.forward(PROMPT), full.forward(PROMPT), np.arange(part.vocab_size))
    close(part.forward([9]), full.forward([9]), np.arange(part.vocab_size))
    with pytest.raises(ValueError, match="head_vocab"):
        export_onnx(qwen_dirs["tied"], tmp_path / "bad", head_vocab=-1)


def test_block_size_and_head_bits_are_export_options(qwen_dirs, tmp_path):
    """Every MatMulNBits takes the export's block size; the LM head its own bits."""
    from specsplit.edge.export.exporter import QuantOptions

    quant = QuantOptions(block=64, head_bits=4)
    out = export_onnx(qwen_dirs["tied"], tmp_path / "b64", precision="int4", quant=quant)
    nodes = [n for n in onnx.load(out / "model.onnx").graph.node if n.op_type == "MatMulNBits"]
    attrs = [{a.name: a.i for a in n.attribute} for n in nodes]
    assert {a["block_size"] for a in attrs} == {64} and {a["bits"] for a in attrs} == {4}
    meta = json.loads((out / "specsplit_draft.json").read_text())
    assert (meta["block_size"], meta["head_bits"]) == (64, 4)
    logits = OnnxDrafter(out, providers=CPU).forward(PROMPT, True)
    assert logits.shape == (len(PROMPT), 256) and np.isfinite(logits).all()
    with pytest.raises(ValueError, match="block size"):
        export_onnx(qwen_dirs["tied"], tmp_path / "bad", "int8", quant=QuantOptions(block=48))
    with pytest.raises(ValueError, match="head_bits"):
        export_onnx(qwen_dirs["tied"], tmp_path / "bad", "int8", quant=QuantOptions(head_bits=2))


def test_an_export_of_graph_format_3_still_runs(draft_exports, tmp_path):
    """Format 4 changed the export's layout (blocks of 128), not its I/O: a format-3 export
    directory given by path runs as before."""
    old = tmp_path / "g3"
    shutil.copytree(draft_exports["tied", "int8"], old)
    meta = json.loads((old / "specsplit_draft.json").read_text())
    (old / "specsplit_draft.json").write_text(json.dumps({**meta, "graph_format": 3}))
    ref = OnnxDrafter(draft_exports["tied", "int8"], providers=CPU).forward(PROMPT)
    np.testing.assert_array_equal(OnnxDrafter(old, providers=CPU).forward(PROMPT), ref)
