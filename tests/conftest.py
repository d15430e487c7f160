"""Shared fixtures: tiny models (target, unrelated draft) with ONNX exports, a real cloud."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from specsplit.cloud.supervision.process import CloudProcess
from specsplit.shared.tiny import make_tiny_qwen2

# Servers the tests start serve the target's float path, the one whose greedy output must equal
# transformers' (the reference these tests compare with). The quantised paths have their own
# tests, against the served target's own cloud-only output (tests/test_quantized_target.py).
os.environ.setdefault("SPECSPLIT_TARGET_WEIGHTS", "float")


@dataclass(frozen=True)
class TinyModels:
    target: Path  # HF dir
    draft: Path  # HF dir, unrelated weights (mostly rejected)
    target_onnx: Path  # the target itself as a draft: everything accepted
    draft_onnx: Path


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> TinyModels:
    from specsplit.edge.export.exporter import export_onnx

    root = tmp_path_factory.mktemp("tiny")
    target = make_tiny_qwen2(root / "target", seed=0)
    draft = make_tiny_qwen2(root / "draft", seed=1)
    return TinyModels(
        target=target,
        draft=draft,
        target_onnx=export_onnx(target, root / "target-onnx"),
        draft_onnx=export_onnx(draft, root / "draft-onnx"),
    )


@pytest.fixture(scope="session")
def cloud(tiny, tmp_path_factory):
    """`specsplit-cloud serve` with the tiny target: real tritonserver + gateway on free ports."""
    with CloudProcess("--target", str(tiny.target), log_dir=tmp_path_factory.mktemp("cloud")) as c:
        yield c
