"""Every weight format the CPU kernels read, by name: one table from a format to its code.

- ``int8`` / ``int4``: our own groups of 32, made from float weights (``cloud.engine.quantized``)
  and laid out for a kernel by ``cloud.engine.kernel_layouts``.
- ``q4_k`` / ``q5_k`` / ``q6_k`` (``cloud.engine.kquants``) and ``q8_0`` / ``q5_0`` / ``q4_0``
  (``cloud.engine.block_quants``): a GGUF file's own blocks, kept at the file's widths and read
  from the file itself (``cloud.engine.gguf_weights``).

Each format has a natural layout (a tuple of tensors whose first dimension is the output columns,
so the linears that read one input concatenate along it) and computes the canonical product of
``cpu_kernels.c``'s header on every kernel, bit for bit.
"""

from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType

import numpy as np
import torch

from specsplit.cloud.engine import kernel_layouts
from specsplit.cloud.engine.kernel_layouts import KernelWeights

OURS = {"int8": 8, "int4": 4}
_GGUF_MODULES = {
    "q4_k": "kquants",
    "q5_k": "kquants",
    "q6_k": "kquants",
    "q8_0": "block_quants",
    "q5_0": "block_quants",
    "q4_0": "block_quants",
}


def _module(fmt: str) -> ModuleType:
    try:
        name = _GGUF_MODULES[fmt]
    except KeyError:
        raise ValueError(f"unknown weight format {fmt!r}") from None
    return importlib.import_module(f"specsplit.cloud.engine.{name}")


def gguf_formats() -> tuple[str, ...]:
    """The GGUF block formats this build serves at their own widths."""
    out = []
    for fmt in _GGUF_MODULES:
        try:
            if fmt in _module(fmt).FORMATS:
                out.append(fmt)
        except ImportError:
            continue
    return tuple(out)


def pack(fmt: str, backend: str, tensors: tuple[torch.Tensor, ...]) -> KernelWeights:
    """Natural-layout weights of ``fmt`` -> ``backend``'s layout."""
    if fmt in OURS:
        w = kernel_layouts.pack(backend, OURS[fmt], tensors)
    else:
        w = _module(fmt).pack(fmt, backend, tensors)
    return w if w.format == fmt else dataclasses.replace(w, format=fmt)


def gemm(x, w: KernelWeights) -> torch.Tensor:
    """[M, N] = x @ w.T for rows ``x`` (``cpu_kernels.QuantizedRows``) in w's kernel."""
    if w.format in OURS:
        from specsplit.cloud.engine import cpu_kernels

        return cpu_kernels.gemm(x, w)
    return _module(w.format).gemm(w.format, x, w)


def from_gguf(fmt: str, raw: np.ndarray) -> tuple[torch.Tensor, ...]:
    """A GGUF tensor's blocks, [N, bytes per row] uint8 -> ``fmt``'s natural layout."""
    return _module(fmt).from_gguf(fmt, raw)


def dequantize(fmt: str, tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """[N, K] float32, the weights ``fmt`` holds (a GGUF format: as ``gguf.quants`` gives them)."""
    return _module(fmt).dequantize(fmt, tensors)
