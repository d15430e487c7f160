"""cloud/engine/quant_cache.py: a kept entry is checked against the model and the format
(every tensor's dtype and shape) before its pointers can reach C; a bad one is discarded with
a WARNING and the model quantised again."""

from __future__ import annotations

import logging

import pytest
import torch

from specsplit.cloud.engine import kernel_library, quant_cache
from specsplit.cloud.engine.quantized import QuantLinear
from specsplit.cloud.engine.ragged import Segment
from specsplit.cloud.engine.target import TargetModel
from specsplit.shared.tiny import make_tiny_qwen2

EXPECTED = quant_cache.Expected(({"qkv": (96, 64), "down": (64, 128)},), (40, 64), "int4")


def _linear(n: int, k: int, seed: int, bias: bool = False) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(k, n, bias=bias)


def _state() -> dict:
    """An entry as quant_cache.save stores it, for EXPECTED: qkv as a 4-bit and an 8-bit part."""
    q, k = _linear(64, 64, 0, bias=True), _linear(32, 64, 1, bias=True)
    return {
        "layers": [
            {
                "qkv": QuantLinear.quantize([q, k], [4, 8]).state(),
                "down": QuantLinear.quantize([_linear(64, 128, 2)], [4]).state(),
            }
        ],
        "lm_head": QuantLinear.quantize([_linear(40, 64, 3)], [8]).state(),
    }


def test_a_matching_entry_passes():
    quant_cache.check(_state(), EXPECTED)


def _qkv_part(state, i):
    return state["layers"][0]["qkv"]["parts"][i][1]


def _scale_dtype(s):
    _qkv_part(s, 0)[1] = _qkv_part(s, 0)[1].to(torch.int8)


def _short_weights(s):
    _qkv_part(s, 1)[0] = _qkv_part(s, 1)[0][:, :32]


def _fewer_rows(s):
    for i, t in enumerate(_qkv_part(s, 1)):
        _qkv_part(s, 1)[i] = t[:16]


def _lm_head_in_4_bits(s):
    s["lm_head"] = QuantLinear.quantize([_linear(40, 64, 3)], [4]).state()


def _bias(s):
    s["layers"][0]["qkv"]["bias"] = torch.zeros(95)


def _missing_tensor(s):
    _qkv_part(s, 0).pop()


def _layers(s):
    s["layers"].append(s["layers"][0])


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (_scale_dtype, r"layer 0 qkv part 0: sc is torch.int8 \[64, 2\], not torch.int16"),
        (
            _short_weights,
            r"layer 0 qkv part 1: q is torch.int8 \[32, 32\], not torch.int8 \[32, 64\]",
        ),
        (_fewer_rows, r"layer 0 qkv: 80 output features, the model has 96"),
        (_lm_head_in_4_bits, r"lm_head part 0: not \[a format of \('int8',\), tensors\]"),
        (_bias, r"layer 0 qkv: the bias is not float32 \[96\]"),
        (_missing_tensor, r"layer 0 qkv part 0: int4 parts hold 5 tensors"),
        (_layers, r"2 layers, the model has 1"),
    ],
)
def test_a_mismatched_entry_is_named_precisely(corrupt, message):
    state = _state()
    corrupt(state)
    with pytest.raises(ValueError, match=message):
        quant_cache.check(state, EXPECTED)


def test_an_int8_format_takes_no_4_bit_part():
    with pytest.raises(ValueError, match=r"layer 0 qkv part 0: not \[a format of \('int8',\)"):
        quant_cache.check(_state(), quant_cache.Expected(EXPECTED.layers, (40, 64), "int8"))


@pytest.mark.skipif(not kernel_library.available(), reason="needs the AVX2 CPU kernels")
def test_a_bad_entry_is_discarded_with_a_warning_and_quantised_again(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SPECSPLIT_CACHE", str(tmp_path / "cache"))
    model_dir = make_tiny_qwen2(tmp_path / "tiny", seed=11)
    first = TargetModel(model_dir, device="cpu", calibrate=False, weights="int4")
    [entry] = (tmp_path / "cache" / "quantized").glob("*.pt")
    state = torch.load(entry, weights_only=True)
    parts = state["layers"][1]["gate_up"]["parts"]
    parts[0][1][1] = parts[0][1][1].to(torch.int32)  # int4 group scales, 4 bytes wide
    torch.save(state, entry)
    with caplog.at_level(logging.WARNING, logger=quant_cache.__name__):
        again = TargetModel(model_dir, device="cpu", calibrate=False, weights="int4")
    [warning] = [r for r in caplog.records if r.name == quant_cache.__name__]
    assert warning.levelno == logging.WARNING and str(entry) in warning.getMessage()
    assert "layer 1 gate_up part 0: sc is torch.int32" in warning.getMessage()
    quant_cache.check(torch.load(entry, weights_only=True), _expected_of(again))  # rewritten
    logits = []
    for target in (first, again):
        slot = target.forward.slots.open(1)
        logits.append(target.forward([Segment(slot, [1, 2, 3, 4], True)])[0])
    assert torch.equal(*logits)


def _expected_of(target: TargetModel) -> quant_cache.Expected:
    c = target.config
    hd = c.hidden_size // c.num_attention_heads
    qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * hd
    layer = {
        "qkv": (qkv, c.hidden_size),
        "o": (c.hidden_size, c.num_attention_heads * hd),
        "gate_up": (2 * c.intermediate_size, c.hidden_size),
        "down": (c.hidden_size, c.intermediate_size),
    }
    vocab = (c.vocab_size, c.hidden_size)
    return quant_cache.Expected((layer,) * c.num_hidden_layers, vocab, target.weights)
