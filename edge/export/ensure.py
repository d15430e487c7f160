"""The draft's ONNX export on first use: found in the cache (``edge.models.find_draft_onnx``),
else fetched, converted and exported once (a build step: the ``export`` extra).

The run-time edge never imports this module; the CLI does, where a user asks for a draft that is
not exported yet.
"""

from __future__ import annotations

from pathlib import Path

from specsplit.edge.models import (
    DEFAULT_DRAFT,
    DEFAULT_PRECISION,
    export_dir,
    find_draft_onnx,
)
from specsplit.shared.build_steps import require_extra, spinner
from specsplit.shared.weights.sources import SOURCES, ensure_hf_dir, resolve_model


def ensure_draft_onnx(
    spec: str | Path = DEFAULT_DRAFT, precision: str = DEFAULT_PRECISION, progress: bool = True
) -> Path:
    """ONNX draft dir for an export dir, a local HF dir or a default name; exported on first use."""
    found = find_draft_onnx(spec, precision)
    if found is not None:
        return found
    require_extra("export", "onnx", *(("rich",) if progress else ()))
    source = SOURCES.get(str(spec))
    # A default name is fetched and converted on first use.
    hf_dir = ensure_hf_dir(source, progress) if source else resolve_model(spec)
    from specsplit.edge.export.exporter import export_onnx  # torch and onnx: only to export

    with spinner(progress) as bar:
        bar.add_task(f"export {hf_dir.name} to ONNX ({precision})", total=None)
        out = export_dir(source or hf_dir, precision)
        return export_onnx(hf_dir, out, precision=precision, progress=progress)
