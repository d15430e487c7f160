"""specsplit: speculative decoding split across a network.

The public API is the edge side, and importing it loads neither torch nor the ONNX Runtime until
a name is used::

    from specsplit import GenerationConfig, OnnxDrafter, SplitClient, SpecsplitError, TextCodec

Subpackages: ``specsplit.edge`` (draft, client, CLI), ``specsplit.cloud`` (gateway, Triton,
target), ``specsplit.shared`` (acceptance math, sampling, protocol helpers, model sources) and
``specsplit.v1`` (the gRPC stubs generated from ``proto/specsplit/v1/speculative.proto``).

This file is the package root; the subpackages live in the repository's top-level ``edge/``,
``cloud/`` and ``shared/`` folders, mapped by ``package-dir`` in ``pyproject.toml``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# name -> module that defines it; imported on first use (PEP 562), so that a cloud install
# without onnxruntime, or a Triton model importing specsplit.cloud, never pays for the edge.
_PUBLIC = {
    "GenerationConfig": "specsplit.edge.client",
    "SplitClient": "specsplit.edge.client",
    "SpecsplitError": "specsplit.edge.client",
    "OnnxDrafter": "specsplit.edge.onnx_drafter",
    "TextCodec": "specsplit.edge.text",
}
__all__ = ["GenerationConfig", "OnnxDrafter", "SpecsplitError", "SplitClient", "TextCodec"]

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from specsplit.edge.client import GenerationConfig, SpecsplitError, SplitClient
    from specsplit.edge.onnx_drafter import OnnxDrafter
    from specsplit.edge.text import TextCodec


def __getattr__(name: str) -> object:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'specsplit' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
