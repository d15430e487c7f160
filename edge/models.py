"""The draft as the edge runs it: an ONNX export, made once and cached.

``ensure_draft_onnx`` takes an export directory (used as is), a local Hugging Face directory, or a
default model name (fetched and converted first). Exporting is a build step that needs the
``export`` extra (onnx; torch, transformers and gguf to convert weights); running an export needs
only the ``edge`` extra. So an edge that pulled its draft ahead of time, or was given an export
directory, never needs the build-step packages.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from specsplit.shared.steps import cache_dir, require_extra, spinner
from specsplit.shared.weights.sources import (
    DRAFT_DEFAULT,
    SOURCES,
    ensure_hf_dir,
    hf_dir_path,
    resolve_model,
)

METADATA = "specsplit_draft.json"
DEFAULT_DRAFT = DRAFT_DEFAULT.name
PRECISIONS = (
    "fp32",
    "int8",
    "int4",
    "fp16",
    "int4-fp16",
)  # edge.export.exporter's weight formats (edge.export.onnx_graph); *fp16: for GPU providers
# The graph's I/O contract (edge.export.onnx_graph), checked by the drafter. 2: the KV cache is one
# buffer per layer written in place (TensorScatter); 1 returned concat(past, new) each step.
GRAPH_FORMAT = 2
# int4: the split is faster with it, though it agrees less with the target. Qwen2.5-Coder-0.5B
# on one Xeon core: int8 52 ms/token, int4 38; teacher-forced agreement with the int4 target on
# code 0.927 vs 0.896 (prose 0.714 vs 0.745): the GGUF's tensors are mostly 5-bit, which 4 bits
# cannot hold. Split tok/s at RTT 0 over 6 chat prompts, code and prose, two runs each: auto
# 10.2 -> 12.0, cloud-led 12.3 -> 13.2 (cloud-only 9.05). int8 stays one flag away.
DEFAULT_PRECISION = "int4"


def export_dir(hf_dir: Path, precision: str) -> Path:
    """Where the export of ``hf_dir`` at ``precision`` is cached (it may not be there yet). The
    graph format is part of the name, so an export an older version made is exported again,
    never run by a drafter that reads another contract."""
    key = hashlib.sha1(str(hf_dir.resolve()).encode()).hexdigest()[:8]
    return cache_dir() / "onnx" / f"{hf_dir.name}-{key}-{precision}-g{GRAPH_FORMAT}"


def ensure_draft_onnx(
    spec: str | Path = DEFAULT_DRAFT, precision: str = DEFAULT_PRECISION, progress: bool = True
) -> Path:
    """ONNX draft dir for an export dir, a local HF dir or a default name; exported on first use."""
    path = Path(spec).expanduser()
    if (path / METADATA).is_file():
        return path
    # A default name's export is found without converting (the HF dir may not exist); any other
    # spec must be a local HF dir (or resolve_model says clearly what is wrong).
    source = SOURCES.get(str(spec))
    hf_dir = hf_dir_path(source) if source else resolve_model(spec)
    out = export_dir(hf_dir, precision)
    if (out / METADATA).is_file():
        return out
    require_extra("export", "onnx", *(("rich",) if progress else ()))
    if source:
        hf_dir = ensure_hf_dir(source, progress)  # fetched and converted on first use
    from specsplit.edge.export.exporter import export_onnx  # build step: not on the run-time path

    with spinner(progress) as bar:
        bar.add_task(f"export {hf_dir.name} to ONNX ({precision})", total=None)
        return export_onnx(hf_dir, out, precision=precision, progress=progress)
