"""Every decoder family the edge exports, against transformers' own model of that family.

Tiny random checkpoints from shared/tiny_families.py (transformers' config and model classes;
sliding windows of 6 tokens, shorter than these sequences; random norm weights; soft-caps low
enough to bite; Llama 3 and LongRoPE rotary scaling), exported at fp32. Tolerance: 1e-4 of the
largest logit (seen: ~1e-6; what differs is float32 summation order).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from specsplit.edge.export.exporter import SafetensorsWeights, export_onnx
from specsplit.edge.export.families import read_spec
from specsplit.edge.export.onnx_graph import build_model
from specsplit.edge.export.rope import Rope
from specsplit.edge.onnx_drafter import OnnxDrafter
from specsplit.shared.tiny_families import FAMILIES, make_tiny, stepwise_greedy, stepwise_logits
from tests.edge.export.test_exporter import on_4bit_grids
from tests.edge.reference import CPU, _hf_model, assert_logits_close, drafter_greedy, hf_logits

IDS = [3, 17, 99, 5, 200, 41, 7, 128, 64, 11, 250, 0, 42, 42, 9, 1, 77, 31, 8, 2]


class Exports(dict):
    """family → (Hugging Face dir, fp32 export), made on first use."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    def __missing__(self, family: str) -> tuple[Path, Path]:
        hf = make_tiny(family, self.root / family, seed=FAMILIES.index(family))
        self[family] = hf, export_onnx(hf, self.root / f"{family}-onnx")
        return self[family]


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> Exports:
    return Exports(tmp_path_factory.mktemp("families"))


def run_contract(drafter: OnnxDrafter) -> np.ndarray:
    """Logits of IDS fed as the draft loop feeds it: a prompt, single steps, a rejected block
    rolled back, then blocks of four after the truncate. [len(IDS), vocab]"""
    got = [drafter.forward(IDS[:10], all_logits=True), drafter.forward(IDS[10:11])]
    got.append(drafter.forward(IDS[11:12]))
    drafter.forward([5, 6, 7])  # rejected
    drafter.truncate(12)
    got += [drafter.forward(IDS[12:16], True), drafter.forward(IDS[16:], True)]
    assert drafter.cached == IDS
    return np.concatenate(got)


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_steps_and_blocks_after_a_truncate_match_transformers(exports, family):
    hf, onnx_dir = exports[family]
    assert json.loads((onnx_dir / "specsplit_draft.json").read_text())["architecture"] == family
    got = run_contract(OnnxDrafter(onnx_dir, providers=CPU))
    assert_logits_close(got, stepwise_logits(_hf_model(hf), IDS).numpy())


@pytest.mark.parametrize("family", FAMILIES)
def test_a_prefill_computes_the_last_positions_logits_only(exports, family):
    """A prompt's pass returns the logits after its last token, [1, vocab], transformers' own
    (the soft-capped head of Gemma 2, a partial rotary, a sliding window before it)."""
    hf, onnx_dir = exports[family]
    got = OnnxDrafter(onnx_dir, providers=CPU).forward(IDS)
    assert_logits_close(got, stepwise_logits(_hf_model(hf), IDS).numpy()[-1:])


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_transformers_one_token_steps(exports, family):
    hf, onnx_dir = exports[family]
    drafter = OnnxDrafter(onnx_dir, providers=CPU)
    assert drafter_greedy(drafter, IDS[:8], 24) == stepwise_greedy(_hf_model(hf), IDS[:8], 24)[8:]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_exports_in_int8_and_int4(exports, family, tmp_path):
    """int8 follows fp32 (block-wise int8 weights and activations); int4, on a copy whose
    projections sit on its 4-bit grids, computes those weights (a wrong nibble errs ~100%)."""
    hf, onnx_dir = exports[family]
    ref = OnnxDrafter(onnx_dir, providers=CPU).forward(IDS, all_logits=True)
    int8 = OnnxDrafter(export_onnx(hf, tmp_path / "int8", precision="int8"), providers=CPU)
    agree = (int8.forward(IDS, all_logits=True).argmax(-1) == ref.argmax(-1)).mean()
    assert agree >= 0.75  # 0.8-1.0 seen
    grid = on_4bit_grids(hf, tmp_path / "grid")
    ref = OnnxDrafter(export_onnx(grid, tmp_path / "grid-fp32"), providers=CPU).forward(IDS, True)
    int4 = OnnxDrafter(export_onnx(grid, tmp_path / "int4", precision="int4"), providers=CPU)
    got = int4.forward(IDS, all_logits=True)
    err = np.linalg.norm(got - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
    assert err.max() < 0.3, err


def _without(rope: Rope) -> Rope:
    """The same rotary with its scaling taken out (plain theta^(-2i/d))."""
    dim = rope.rotary_dim
    theta = 10000.0
    inv = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    return Rope(tuple(float(v) for v in inv.astype(np.float32)), dim)


# (family, what is taken out of its spec): each must move the logits far beyond the tolerance,
# so the tests above would catch it missing
TRAITS = [
    ("mistral", lambda s: {"windows": (None,) * s.num_layers}),
    ("qwen2", lambda s: {"windows": (None,) * s.num_layers}),
    ("gemma2", lambda s: {"windows": (None,) * s.num_layers}),
    ("gemma2", lambda s: {"attn_softcap": None}),
    ("gemma2", lambda s: {"final_softcap": None}),
    ("gemma2", lambda s: {"embed_scale": None}),
    ("gemma2", lambda s: {"attn_scale": s.head_dim**-0.5}),
    ("gemma3_text", lambda s: {"ropes": {k: s.ropes["full_attention"] for k in s.ropes}}),
    ("gemma3_text", lambda s: {"qk_norm": False}),
    ("qwen3", lambda s: {"qk_norm": False}),
    ("llama", lambda s: {"ropes": {"rope": _without(s.ropes["rope"])}}),
]


@pytest.mark.parametrize(("family", "change"), TRAITS)
def test_each_family_trait_matters_on_these_models(exports, family, change, tmp_path):
    hf, onnx_dir = exports[family]
    spec = read_spec(json.loads((hf / "config.json").read_text()), has_lm_head=True)
    spec = dataclasses.replace(spec, **change(spec))
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in onnx_dir.iterdir():
        if not f.name.startswith("model.onnx"):
            (broken / f.name).write_bytes(f.read_bytes())
    build_model(spec, SafetensorsWeights(hf), broken / "model.onnx")
    got = OnnxDrafter(broken, providers=CPU).forward(IDS, all_logits=True)
    ref = hf_logits(hf, IDS)
    assert np.abs(got - ref).max() > 1e-2 * np.abs(ref).max()


def test_longrope_switches_to_long_factors_from_the_original_length(tmp_path):
    """Phi-3 LongRoPE past original_max_position_embeddings (here 64, of 1,024 positions): a
    position's rotation uses the long factors from 64 on, scaled by sqrt(1 + ln 16 / ln 64), as
    transformers' one-token steps do, however the tokens are split into calls."""
    import torch
    from transformers import AutoModelForCausalLM, Phi3Config, Phi3ForCausalLM

    config = Phi3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        original_max_position_embeddings=64,
        partial_rotary_factor=0.5,
        initializer_range=0.2,
        pad_token_id=None,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7],
            "long_factor": [2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 5.5],
        },
    )
    torch.manual_seed(0)
    Phi3ForCausalLM(config).save_pretrained(tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids = list(np.random.default_rng(0).integers(0, 256, 80))
    with torch.no_grad():  # 60 positions in one call (all short), then one step at a time
        out = model(torch.tensor([ids[:60]]), use_cache=True)
        ref = [out.logits[0].numpy()]
        for token in ids[60:]:
            out = model(torch.tensor([[token]]), cache=out.cache, use_cache=True)
            ref.append(out.logits[0].numpy())
    ref = np.concatenate(ref)
    drafter = OnnxDrafter(export_onnx(tmp_path / "hf", tmp_path / "onnx"), providers=CPU)
    for splits in ([60, 80], [30, 62, 66, 80]):
        drafter.reset()
        got = [drafter.forward(ids[a:b], True) for a, b in zip([0, *splits], splits, strict=False)]
        assert_logits_close(np.concatenate(got), ref)
    # the control: the same graph never switching to the long factors is transformers' only
    # before position 64
    spec = read_spec(json.loads((tmp_path / "hf" / "config.json").read_text()), True)
    rope = spec.ropes["rope"]
    assert (rope.long_from, round(rope.scaling, 4)) == (64, 1.291)
    short = dataclasses.replace(rope, long_inv_freq=None)
    build_model(
        dataclasses.replace(spec, ropes={"rope": short}),
        SafetensorsWeights(tmp_path / "hf"),
        tmp_path / "onnx" / "model.onnx",
    )
    got = OnnxDrafter(tmp_path / "onnx", providers=CPU).forward(ids, all_logits=True)
    assert_logits_close(got[:64], ref[:64])
    assert np.abs(got[64:] - ref[64:]).max() > 1e-2 * np.abs(ref).max()
