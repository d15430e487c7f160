"""``--weights auto`` (cloud/engine/precision.py) never fails a model the float path serves:
where the CPU kernels cannot serve it (none on this machine, or widths they do not read), it
serves float and says why in a WARNING, before probing the weights in the kernels' groups."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch
from transformers import Qwen2Config

from specsplit.cloud.engine import kernel_library, precision
from specsplit.cloud.engine.target import SessionParams, TargetModel
from specsplit.cloud.supervision.process import CloudProcess
from specsplit.edge.client import GenerationConfig, SplitClient
from specsplit.shared.acceptance import VerificationRule
from specsplit.shared.sampling import SamplingConfig
from specsplit.shared.tiny import make_tiny_qwen2, reference_greedy

CPU = torch.device("cpu")


def _config(hidden: int) -> Qwen2Config:
    return Qwen2Config(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=1,
        vocab_size=256,
    )


def _no_probe() -> bool:
    raise AssertionError("probed a model the kernels cannot read")


def test_auto_serves_float_where_the_widths_do_not_suit_the_kernels(monkeypatch, caplog):
    monkeypatch.setattr(kernel_library, "unavailable", lambda: None)
    with caplog.at_level(logging.WARNING, logger=precision.__name__):
        fmt, dtype = precision.choose("auto", "auto", CPU, _config(88), _no_probe)
    assert fmt == "float" and dtype in (torch.float32, torch.bfloat16)
    [warning] = caplog.records
    assert warning.levelno == logging.WARNING
    assert "--weights auto serves float" in warning.getMessage()
    assert "hidden 88" in warning.getMessage() and "10x slower" in warning.getMessage()


def test_auto_serves_float_where_there_are_no_kernels(monkeypatch, caplog):
    monkeypatch.setattr(kernel_library, "unavailable", lambda: "no C compiler (cc/gcc)")
    with caplog.at_level(logging.WARNING, logger=precision.__name__):
        fmt, _ = precision.choose("auto", "auto", CPU, _config(64), _no_probe)
    assert fmt == "float"
    assert "no C compiler" in caplog.text


def test_auto_asks_about_4_bit_grids_only_where_the_kernels_fit(monkeypatch):
    monkeypatch.setattr(kernel_library, "unavailable", lambda: None)
    monkeypatch.setattr(
        precision, "calibrate", lambda config, q, *_: {q: {1: 0.0}, "float32": {1: 1}}
    )
    asked = []
    fmt, _ = precision.choose("auto", "auto", CPU, _config(64), lambda: asked.append(1) or True)
    assert (fmt, asked) == ("int4", [1])


def test_a_hidden_size_of_88_is_served_in_float_with_default_flags(tmp_path, caplog):
    """As ``specsplit-cloud serve --target <dir>`` loads it (weights and dtype auto): it used
    to fail with "input dimension 88 is not a multiple of 64" from the 4-bit-source probe."""
    model_dir = make_tiny_qwen2(tmp_path / "tiny88", seed=5, hidden_size=88)
    with caplog.at_level(logging.WARNING):
        target = TargetModel(model_dir, device="cpu", calibrate=False)
    assert target.weights == "float"
    assert any(
        r.levelno == logging.WARNING and "float" in r.getMessage() for r in caplog.records
    ), caplog.text
    params = SessionParams(SamplingConfig(temperature=0.0), VerificationRule.GREEDY)
    target.start(1, [1, 2, 3], params)
    result = target.verify(1, 3, [3, 4, 5])
    assert 0 <= result.accepted <= 2


@pytest.mark.slow
def test_serve_with_default_flags_answers_from_a_hidden_size_of_88(tmp_path):
    """`specsplit-cloud serve --target <dir>`, a real tritonserver and gateway: ready, the
    cloud-only answer is transformers' greedy one, and Triton's log says why it serves float."""
    model_dir = make_tiny_qwen2(tmp_path / "tiny88", seed=5, hidden_size=88)
    prompt, n_new = [1, 2, 3, 4], 8
    logs = tmp_path / "logs"
    # --weights auto is serve's default; said here because tests/conftest.py makes float the
    # default of the servers tests start.
    args = ("--target", str(model_dir), "--weights", "auto", "--triton-log-dir", str(logs))
    with CloudProcess(*args, log_dir=tmp_path) as cloud:
        got = asyncio.run(_cloud_only(cloud.address, prompt, n_new))
    assert got == reference_greedy(model_dir, prompt, n_new)
    triton_log = "\n".join(p.read_text(errors="replace") for p in logs.rglob("*") if p.is_file())
    assert "--weights auto serves float" in triton_log and "hidden 88" in triton_log


async def _cloud_only(address: str, prompt: list[int], n_new: int) -> list[int]:
    async with SplitClient(address, None) as client:
        gen = client.generate(prompt, GenerationConfig(max_new_tokens=n_new), route="cloud-only")
        await gen.collect()
        return gen.token_ids


def test_auto_dtype_is_float32_on_a_gpu_too():
    """bfloat16 flipped greedy tokens between batched and alone on an H200 (docs/gpu.md): auto
    never chooses it, on any device; asked for by name it is served."""
    from specsplit.cloud.engine.precision import resolve_dtype

    for device in ("cpu", "cuda"):
        assert resolve_dtype("auto", torch.device(device)) is torch.float32
    assert resolve_dtype("bfloat16", torch.device("cuda")) is torch.bfloat16
