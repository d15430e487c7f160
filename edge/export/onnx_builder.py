"""Assembling an ONNX graph from numpy weights: initializers streamed to one external-data file,
nodes added through small helpers (Linear as MatMul or MatMulNBits, RMSNorm). Build-step code:
numpy + onnx; ``edge.export.onnx_graph`` decides what the graph computes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from specsplit.edge.export.onnx_quant import (
    BLOCK_SIZES,
    DEFAULT_BLOCK,
    block_for,
    quantize_blocks,
    quantize_blocks_4bit,
)

HALF = ("fp16", "int4-fp16")  # precisions whose Linears compute in float16

_ALIGN = 4096  # page-aligned external-data offsets (lets ORT mmap large initializers)
_INLINE_BYTES = 4096  # smaller tensors stay inside model.onnx


class ExternalData:
    """Streams large initializers into one side file as they are created (no 2 GB proto)."""

    def __init__(self, path: Path) -> None:
        self._file = path.open("wb")
        self._location = path.name
        self._offset = 0

    def tensor(self, name: str, array: np.ndarray) -> TensorProto:
        array = np.ascontiguousarray(array)
        if array.nbytes < _INLINE_BYTES:
            return numpy_helper.from_array(array, name)
        pad = -self._offset % _ALIGN
        self._file.write(b"\0" * pad)
        self._offset += pad
        tensor = TensorProto(name=name, dims=list(array.shape))
        tensor.data_type = helper.np_dtype_to_tensor_dtype(array.dtype)
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (
            ("location", self._location),
            ("offset", str(self._offset)),
            ("length", str(array.nbytes)),
        ):
            tensor.external_data.add(key=key, value=value)
        self._file.write(memoryview(array).cast("B"))
        self._offset += array.nbytes
        return tensor

    def close(self) -> None:
        self._file.close()


class GraphBuilder:
    """Accumulates nodes and initializers; every helper returns its output name."""

    def __init__(self, data: ExternalData, precision: str, block: int = DEFAULT_BLOCK) -> None:
        if block not in BLOCK_SIZES:
            raise ValueError(f"block size must be one of {BLOCK_SIZES}, not {block}")
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[TensorProto] = []
        self.precision = precision
        # int8 embedding table and LM head for the 4-bit formats too
        self.int8 = precision not in ("fp32", "fp16")
        # Linears computed in float16 (their inputs cast down, their outputs back up): the GPU
        # providers' fast GEMMs and MatMulNBits kernels take fp16 activations
        self.half = precision in HALF
        self.block = block  # inputs per weight scale of every MatMulNBits
        self._data = data
        self._count = 0
        self._consts: set[str] = set()

    def op(
        self,
        op_type: str,
        inputs: list[str],
        n_out: int = 1,
        out: str | None = None,
        **attrs,
    ) -> str | list[str]:
        """One node; returns its output name (a list when ``n_out`` > 1)."""
        self._count += 1
        names = [out] if out else [""] * n_out
        names = [n or f"{op_type.lower()}_{self._count}_{i}" for i, n in enumerate(names)]
        self.nodes.append(
            helper.make_node(op_type, inputs, names, name=f"{op_type}_{self._count}", **attrs)
        )
        return names[0] if len(names) == 1 else names

    def const(self, name: str, array: np.ndarray) -> str:
        """An initializer; a name already written is reused (per-layer helpers share shapes)."""
        if name not in self._consts:
            self._consts.add(name)
            self.initializers.append(self._data.tensor(name, array))
        return name

    def ints(self, name: str, values: int | list[int]) -> str:
        return self.const(name, np.asarray(values, dtype=np.int64))

    def linear(
        self,
        x: str,
        weight: np.ndarray,
        name: str,
        out: str | None = None,
        bits: int = 0,
        bias: np.ndarray | None = None,
    ) -> str:
        """x @ weight.T (+ bias) for an HF Linear weight [out, in]: MatMul, or MatMulNBits in
        ``bits`` (default: the graph's precision); in float16 for the ``HALF`` precisions, x
        cast down first and the product cast back to float32 (the bias is added in float32)."""
        if bias is not None:
            y = self.linear(x, weight, name, bits=bits)
            return self.op("Add", [y, self.const(f"{name}.bias", bias)], out=out)
        if not self.half:
            return self._product(x, weight, name, bits, out)
        x16 = self.op("Cast", [x], to=TensorProto.FLOAT16)
        return self.op(
            "Cast", [self._product(x16, weight, name, bits)], to=TensorProto.FLOAT, out=out
        )

    def _product(self, x: str, weight: np.ndarray, name: str, bits: int, out: str | None = None):
        dtype = np.float16 if self.half else np.float32  # of x, the weight and the scales
        if not self.int8:
            return self.op(
                "MatMul", [x, self.const(f"{name}.weight_t", weight.T.astype(dtype))], out=out
            )
        n, k = weight.shape
        bits = bits or (4 if self.precision in ("int4", "int4-fp16") else 8)
        block = self.block
        if bits == 8:
            blocks, scales = quantize_blocks(weight, block)  # [n, k/b, b], [n * k/b]
            zero = []
        else:
            block = block_for(k, block)
            blocks, scales, zeros = quantize_blocks_4bit(weight, block)
            zero = [self.const(f"{name}.zero_q4", zeros)]
        inputs = [x, self.const(f"{name}.weight_q{bits}", blocks)]
        inputs += [self.const(f"{name}.scale", scales.astype(dtype)), *zero]
        return self.op(
            "MatMulNBits", inputs, out=out, domain="com.microsoft",
            K=k, N=n, bits=bits, block_size=block, accuracy_level=4,
        )  # fmt: skip

    def rms_norm(self, x: str, weight: np.ndarray, name: str, eps: float) -> str:
        # The Pow→ReduceMean→Add→Sqrt→Div→Mul pattern ORT fuses into SimplifiedLayerNormalization.
        sq = self.op("Pow", [x, self.const("c_two", f32(2.0))])
        var = self.op("ReduceMean", [sq, self.ints("axes_last", [-1])], keepdims=1)
        std = self.op("Sqrt", [self.op("Add", [var, self.const(f"{name}.eps", f32(eps))])])
        return self.op("Mul", [self.op("Div", [x, std]), self.const(f"{name}.weight", weight)])


def f32(value: float) -> np.ndarray:
    return np.asarray(value, dtype=np.float32)
