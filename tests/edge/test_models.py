"""edge.models: where the draft's export is cached, found by what the model is, not where (and
edge.export.ensure, which uses what is found instead of exporting again)."""

from __future__ import annotations

import hashlib
import shutil

import pytest

from specsplit.edge import models
from specsplit.edge.export import ensure
from specsplit.edge.export.ensure import ensure_draft_onnx
from specsplit.edge.models import DEFAULT_DRAFT, METADATA, export_dir, find_draft_onnx
from specsplit.shared.weights.sources import SOURCES


def _fake_export(path):
    path.mkdir(parents=True)
    (path / METADATA).write_text("{}")
    return path


def _no_export(*_a, **_kw):
    raise AssertionError("exported again")


def test_a_copied_cache_finds_the_default_drafts_export(tmp_path, monkeypatch):
    """A cache moved to another path (user, mount) still holds the default draft's export: a
    lean edge finds it without the export extra, fetching or exporting nothing."""
    monkeypatch.setenv("SPECSPLIT_CACHE", str(tmp_path / "a"))
    _fake_export(export_dir(SOURCES[DEFAULT_DRAFT], "int4"))
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    monkeypatch.setenv("SPECSPLIT_CACHE", str(tmp_path / "b"))
    monkeypatch.setattr(ensure, "require_extra", _no_export)
    found = ensure_draft_onnx(DEFAULT_DRAFT, "int4", progress=False)
    assert found.parent == tmp_path / "b" / "onnx"


def test_a_copied_model_dir_is_keyed_by_its_contents(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSPLIT_CACHE", str(tmp_path / "cache"))
    hf = tmp_path / "m" / "draft"
    hf.mkdir(parents=True)
    (hf / "config.json").write_text('{"model_type": "llama"}')
    (hf / "model.safetensors").write_bytes(b"\0" * 1000)
    copy = shutil.copytree(hf, tmp_path / "elsewhere" / "draft")
    assert export_dir(copy, "int8") == export_dir(hf, "int8")
    _fake_export(export_dir(hf, "int8"))
    monkeypatch.setattr(ensure, "require_extra", _no_export)
    assert ensure_draft_onnx(copy, "int8", progress=False) == export_dir(hf, "int8")
    (copy / "model.safetensors").write_bytes(b"\1" * 1000)  # other weights, same size
    assert export_dir(copy, "int8") != export_dir(hf, "int8")
    assert export_dir(hf, "int4") != export_dir(hf, "int8")


def test_an_export_under_its_old_path_keyed_name_is_still_found(tmp_path, monkeypatch):
    """Exports made before content keys are used where they are, not exported again."""
    monkeypatch.setenv("SPECSPLIT_CACHE", str(tmp_path))
    hf = SOURCES[DEFAULT_DRAFT]
    hf_dir = tmp_path / "hf" / hf.name
    key = hashlib.sha1(str(hf_dir.resolve()).encode()).hexdigest()[:8]
    old = _fake_export(tmp_path / "onnx" / f"{hf.name}-{key}-int4-g{models.GRAPH_FORMAT}")
    monkeypatch.setattr(ensure, "require_extra", _no_export)
    assert ensure_draft_onnx(DEFAULT_DRAFT, "int4", progress=False) == old


def test_a_model_path_that_is_no_directory_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        models.content_key(tmp_path / "missing")


def test_a_draft_not_exported_yet_is_not_found(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSPLIT_CACHE", str(tmp_path))
    assert find_draft_onnx(DEFAULT_DRAFT, "int4") is None
    assert find_draft_onnx(_fake_export(tmp_path / "mine"), "int8") == tmp_path / "mine"
