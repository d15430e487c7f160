"""`python -m bench.draft_gemm`: ONNX Runtime's one-thread GEMM rates for the draft's Linears.

One Linear of Qwen2.5-0.5B's MLP (gate+up: 896 inputs, 9,728 outputs) as a one-node graph per
weight format: fp32 MatMul (MLAS sgemm), MatMulNBits 4- and 8-bit at each block size and
accuracy level (the draft's own layouts, ``edge.export.onnx_quant``), and DynamicQuantizeMatMul
(int8 weights per column, activations u8 with one scale per call: MLAS's u8s8 GEMM). Rows m = 1
is a draft step, m > 1 a prefill chunk. Rates are in CPU time of this process (one thread);
pin it to one core (``taskset -c 0``). It says which kernel a prefill can hope for.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

# (label, kind, bits, block, accuracy_level)
FORMATS = (
    ("fp32 MatMul", "fp32", 0, 0, 0),
    ("int4 b32 acc4", "nbits", 4, 32, 4),
    ("int4 b32 acc0", "nbits", 4, 32, 0),
    ("int4 b64 acc4", "nbits", 4, 64, 4),
    ("int4 b128 acc4", "nbits", 4, 128, 4),
    ("int8 b32 acc4", "nbits", 8, 32, 4),
    ("int8 b128 acc4", "nbits", 8, 128, 4),
    ("u8s8 DynamicQuantizeMatMul", "dqmm", 8, 0, 0),
)


def gemm_session(weight: np.ndarray, kind: str, bits: int, block: int, accuracy: int):
    """A one-thread session computing x @ weight.T for x [1, m, k]; weight [n, k]."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from specsplit.edge.export.onnx_quant import quantize_blocks, quantize_blocks_4bit

    n, k = weight.shape
    arrays: dict[str, np.ndarray] = {}
    if kind == "fp32":
        arrays["w"] = np.ascontiguousarray(weight.T)
        node = helper.make_node("MatMul", ["x", "w"], ["y"])
    elif kind == "dqmm":
        scale = np.maximum(np.abs(weight).max(axis=1), 1e-12) / 127.0  # [n]
        arrays["w"] = np.ascontiguousarray(np.rint(weight.T / scale).astype(np.int8))  # [k, n]
        arrays["s"] = scale.astype(np.float32)
        node = helper.make_node("DynamicQuantizeMatMul", ["x", "w", "s"], ["y"])
        node.domain = "com.microsoft"
    else:
        if bits == 4:
            arrays["w"], arrays["s"], arrays["z"] = quantize_blocks_4bit(weight, block)
        else:
            arrays["w"], arrays["s"] = quantize_blocks(weight, block)
        node = helper.make_node(
            "MatMulNBits", list(("x", *arrays)), ["y"], domain="com.microsoft",
            K=k, N=n, bits=bits, block_size=block, accuracy_level=accuracy,
        )  # fmt: skip
    graph = helper.make_graph(
        [node],
        "gemm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "m", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "m", n])],
        [numpy_helper.from_array(a, name) for name, a in arrays.items()],
    )
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=10)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, ["CPUExecutionProvider"])


def gops(session, m: int, k: int, n: int, seconds: float = 0.5) -> float:
    """Multiply-adds x2 per second of CPU time, in billions, at ``m`` rows."""
    x = np.random.default_rng(0).standard_normal((1, m, k)).astype(np.float32)
    session.run(None, {"x": x})
    runs, start = 0, time.process_time()
    while (spent := time.process_time() - start) < seconds or runs < 3:
        session.run(None, {"x": x})
        runs += 1
    return 2 * m * k * n * runs / spent / 1e9


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.draft_gemm", description=__doc__)
    p.add_argument("--k", type=int, default=896)
    p.add_argument("--n", type=int, default=9728)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 146, 512])
    args = p.parse_args(argv)
    weight = np.random.default_rng(1).standard_normal((args.n, args.k)).astype(np.float32) * 0.02
    print("| format | " + " | ".join(f"m={m} GOP/s" for m in args.rows) + " |")
    print("|---|" + "---|" * len(args.rows))
    for label, kind, bits, block, accuracy in FORMATS:
        session = gemm_session(weight, kind, bits, block, accuracy)
        rates = [gops(session, m, args.k, args.n) for m in args.rows]
        print(f"| {label} | " + " | ".join(f"{r:.0f}" for r in rates) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
