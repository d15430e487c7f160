"""The draft's execution provider (edge.onnx_drafter): chosen from what the installed ONNX
Runtime offers, overridden by --provider, shown by `specsplit-edge info`.

Only the CPU provider runs here (no GPU, no Mac, no Windows): the choice among the others is
checked against a runtime that claims to offer them (``ort.get_available_providers`` and the
WebGPU plugin faked), and the CPU provider end to end.
"""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from specsplit.edge import onnx_drafter
from specsplit.edge.onnx_drafter import (
    OnnxDrafter,
    available_providers,
    choose_provider,
    ms_per_token,
    session_providers,
)

EDGE = str(Path(sys.executable).parent / "specsplit-edge")
EP = onnx_drafter.PROVIDERS


@pytest.fixture
def offers(monkeypatch):
    """Makes the runtime offer the given --provider names (WebGPU through a fake plugin)."""

    def offer(*names: str) -> None:
        monkeypatch.setattr(ort, "get_available_providers", lambda: [EP[n] for n in names])
        device = object() if "webgpu" in names else None
        monkeypatch.setattr(onnx_drafter, "webgpu_device", lambda: device)

    return offer


@pytest.mark.parametrize(
    "offered, chosen",
    [
        (("cpu", "cuda"), "cuda"),
        (("cpu", "coreml"), "coreml"),
        (("cpu", "directml"), "directml"),
        (("cpu", "webgpu"), "webgpu"),
        (("webgpu", "cpu", "coreml"), "coreml"),
        (("cpu",), "cpu"),
    ],
)
def test_auto_picks_the_accelerator_before_the_cpu(offers, offered, chosen):
    offers(*offered)
    assert choose_provider() == chosen
    assert available_providers()[-1] == "cpu"


def test_auto_skips_coreml_for_a_quantised_graph(offers):
    """CoreML has no MatMulNBits: an int4 graph would run its matmuls on the CPU in pieces."""
    offers("cpu", "coreml", "webgpu")
    assert choose_provider("auto", "int4") == "webgpu"
    assert choose_provider("auto", "fp16") == "coreml"
    assert choose_provider("coreml", "int4") == "coreml"  # asked for by name: as asked


def test_a_provider_this_runtime_lacks_is_refused_saying_where_it_comes_from(offers):
    offers("cpu")
    with pytest.raises(ValueError, match="not offered .* onnxruntime-ep-webgpu"):
        choose_provider("webgpu")
    with pytest.raises(ValueError, match="must be one of auto, cuda, coreml"):
        choose_provider("tpu")


def test_the_webgpu_plugin_is_registered_when_installed(monkeypatch):
    registered = []
    device = types.SimpleNamespace(ep_name="WebGpuExecutionProvider")
    plugin = types.ModuleType("onnxruntime_ep_webgpu")
    plugin.get_library_path = lambda: "/plugin/libonnxruntime_providers_webgpu.so"
    plugin.get_ep_name = lambda: "WebGpuExecutionProvider"
    monkeypatch.setitem(sys.modules, "onnxruntime_ep_webgpu", plugin)
    monkeypatch.setattr(onnx_drafter, "_webgpu", [])
    monkeypatch.setattr(
        ort, "register_execution_provider_library", lambda *a: registered.append(a), raising=False
    )
    monkeypatch.setattr(ort, "get_ep_devices", lambda: [device], raising=False)
    assert onnx_drafter.webgpu_device() is device
    assert registered == [("webgpu", "/plugin/libonnxruntime_providers_webgpu.so")]
    assert "webgpu" in available_providers()


def test_a_webgpu_plugin_that_cannot_load_is_not_offered(monkeypatch):
    plugin = types.ModuleType("onnxruntime_ep_webgpu")
    plugin.get_library_path = lambda: "/nowhere.so"
    plugin.get_ep_name = lambda: "WebGpuExecutionProvider"
    monkeypatch.setitem(sys.modules, "onnxruntime_ep_webgpu", plugin)
    monkeypatch.setattr(onnx_drafter, "_webgpu", [])

    def fail(*a):
        raise RuntimeError("libvulkan.so.1: cannot open shared object file")

    monkeypatch.setattr(ort, "register_execution_provider_library", fail, raising=False)
    assert onnx_drafter.webgpu_device() is None


def test_session_providers_put_the_cpu_after_the_accelerator():
    options = ort.SessionOptions()
    assert session_providers("cpu", options) == ["CPUExecutionProvider"]
    assert session_providers("cuda", options) == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert session_providers("directml", options)[0] == "DmlExecutionProvider"
    assert options.enable_mem_pattern is False


def test_the_cpu_provider_runs_the_draft_as_auto_does(tiny):
    """Asked for by name, the CPU provider gives the logits the default choice gives (here
    CUDA, when offered, falls back to the CPU: no GPU)."""
    cpu = OnnxDrafter(tiny.draft_onnx, provider="cpu")
    auto = OnnxDrafter(tiny.draft_onnx)
    assert cpu.provider == "CPUExecutionProvider"
    ids = [1, 2, 3, 4, 5]
    np.testing.assert_array_equal(cpu.forward(ids), auto.forward(ids))
    assert ms_per_token(cpu, steps=3) > 0 and cpu.cached == []


def test_info_prints_the_provider_threads_and_ms_per_token(tiny):
    r = subprocess.run(
        [EDGE, "info", "--draft", str(tiny.draft_onnx), "--provider", "cpu", "--steps", "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    lines = dict(line.split(None, 1) for line in r.stdout.splitlines())
    assert lines["provider"] == "CPUExecutionProvider (asked: cpu)"
    assert "cpu" in lines["offered"] and lines["runtime"].startswith("onnxruntime")
    assert "default" in lines["threads"]
    assert float(lines["ms/token"].split()[0]) > 0


def test_info_refuses_a_provider_this_runtime_lacks(tiny):
    r = subprocess.run(
        [EDGE, "info", "--draft", str(tiny.draft_onnx), "--provider", "coreml"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "provider 'coreml' is not offered" in r.stderr
