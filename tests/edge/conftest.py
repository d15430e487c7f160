"""Tiny Qwen2 checkpoints (tied, untied, sharded bf16) and their ONNX exports, made once a run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specsplit.shared.tiny import make_tiny_qwen2


def make_untied(path: Path, seed: int) -> Path:
    """A tiny Qwen2 whose lm_head is its own (random) matrix, not the embedding."""
    import torch
    from safetensors.torch import load_file, save_file

    make_tiny_qwen2(path, seed=seed)
    weights = load_file(path / "model.safetensors")
    generator = torch.Generator().manual_seed(seed + 1000)
    embed = weights["model.embed_tokens.weight"]
    weights["lm_head.weight"] = torch.randn(embed.shape, generator=generator) * 0.2
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (path / "config.json").write_text(json.dumps(config))
    return path


def make_sharded_bf16(path: Path, seed: int) -> Path:
    """A tiny Qwen2 saved in bfloat16 across several safetensors shards with an index."""
    import torch
    from transformers import AutoModelForCausalLM

    make_tiny_qwen2(path / "src", seed=seed)
    model = AutoModelForCausalLM.from_pretrained(path / "src", dtype=torch.bfloat16)
    model.save_pretrained(path / "hf", max_shard_size="40KB")
    assert (path / "hf" / "model.safetensors.index.json").exists()
    return path / "hf"


@pytest.fixture(scope="session")
def qwen_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {
        "tied": make_tiny_qwen2(root / "tied", seed=0),
        "untied": make_untied(root / "untied", seed=1),
        "bf16_sharded": make_sharded_bf16(root / "bf16", seed=2),
    }


class LazyExports(dict):
    """(model kind, precision) → exported directory, exported on first use."""

    def __init__(self, qwen_dirs: dict[str, Path], root: Path) -> None:
        super().__init__()
        self._models, self._root = qwen_dirs, root

    def __missing__(self, key: tuple[str, str]) -> Path:
        from specsplit.edge.export.exporter import export_onnx

        kind, precision = key
        self[key] = export_onnx(self._models[kind], self._root / f"{kind}-{precision}", precision)
        return self[key]


@pytest.fixture(scope="session")
def draft_exports(
    qwen_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> LazyExports:
    return LazyExports(qwen_dirs, tmp_path_factory.mktemp("onnx"))
