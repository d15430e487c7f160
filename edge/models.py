"""The draft as the edge runs it: an ONNX export, made once and cached beside the HF weights."""

from __future__ import annotations

import hashlib
from pathlib import Path

from specsplit.shared.sources import cache_dir, resolve_model

METADATA = "specsplit_draft.json"


def ensure_draft_onnx(spec: str | Path, precision: str = "int8", progress: bool = True) -> Path:
    """ONNX draft dir for a default model name or a local HF dir; exported on first use.

    An existing export dir (holding specsplit_draft.json) is returned as is.
    """
    path = Path(spec).expanduser()
    if (path / METADATA).is_file():
        return path
    hf_dir = resolve_model(spec)
    key = hashlib.sha1(str(hf_dir.resolve()).encode()).hexdigest()[:8]
    out = cache_dir() / "onnx" / f"{hf_dir.name}-{key}-{precision}"
    if (out / METADATA).is_file():
        return out
    from specsplit.edge.export import (
        export_onnx,  # build step: needs onnx, not on the run-time path
    )

    return export_onnx(hf_dir, out, precision=precision, progress=progress)
