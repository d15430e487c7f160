"""Builds the ONNX graph of a Qwen2 causal LM with an explicit KV cache, straight from weights.

Contract (the drafter depends on it; ``GRAPH_FORMAT`` changes whenever it does):

    inputs   input_ids        int64    [1, seq]
             position_ids     int64    [1, seq]   absolute positions past_len .. past_len+seq-1
             past_key.{i}     float32  [1, kv_heads, past_len, head_dim]   (past_len may be 0)
             past_value.{i}   float32  [1, kv_heads, past_len, head_dim]
    outputs  logits           float32  [1, seq, vocab]
             present_key.{i}  float32  [1, kv_heads, past_len+seq, head_dim]
             present_value.{i} float32 [1, kv_heads, past_len+seq, head_dim]

Everything else (rotary tables, the causal mask) lives inside the graph, so any ONNX Runtime
client can run it with positions alone. The math follows transformers' ``Qwen2ForCausalLM``:
RMSNorm → q/k/v (with bias) → rotary (rotate_half) → grouped-query attention, causal over
past+new → o_proj → residual → RMSNorm → down(silu(gate) * up) → residual; final norm; lm_head.

Graph-level choices, all exact rewrites of that math:
- q/k/v and gate/up projections are fused into one MatMul each (fewer kernels per token).
- 1/sqrt(head_dim) is folded into the q weights and bias (rotary is linear in q).
- GQA without repeat_kv: q is reshaped to [1, kv_heads, group*seq, head_dim] so each kv head
  multiplies its whole query group at once; the mask is tiled to [group*seq, total].
- Large tensors are written as ONNX external data (the real models exceed protobuf's 2 GB).

Precision "int8" is quantised here, not by a separate pass: every Linear becomes
com.microsoft MatMulNBits (8-bit weights, symmetric, one scale per ``INT8_BLOCK`` inputs;
accuracy_level 4 lets ORT quantise activations per block too and use int8 dot products), the
embedding a per-row int8 table. Norms, biases, rotary and attention stay fp32. Measured on
Qwen2.5-Coder-0.5B this is ~10x closer to fp32 logits than onnxruntime's quantize_dynamic
(per-tensor activation scales), at about the same speed. Precision "int4" makes every Linear
but the LM head 4-bit MatMulNBits (asymmetric blocks of 32 with integer zero points: float zero
points, which could hold a Q4_K group exactly, send ORT to a ~50x slower kernel); the LM head
stays int8, its logits being what the draft is judged by.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

log = logging.getLogger(__name__)

GRAPH_FORMAT = 1
INT8_BLOCK = 32  # inputs per int8 weight scale (MatMulNBits block_size)
OPSET = 17  # ReduceMean still takes axes as an attribute; ORT fuses the RMSNorm pattern
IR_VERSION = 8  # ONNX Runtime rejects the newest IR versions onnx writes by default
_ALIGN = 4096  # page-aligned external-data offsets (lets ORT mmap large initializers)
_INLINE_BYTES = 4096  # smaller tensors stay inside model.onnx


@dataclass(frozen=True)
class Qwen2Spec:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_positions: int
    tied_embeddings: bool

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads


def rope_tables(spec: Qwen2Spec) -> tuple[np.ndarray, np.ndarray]:
    """cos and sign-folded sin, [max_positions, head_dim] float32, computed as transformers does.

    rotate_half(x) * sin == swap_halves(x) * sin_folded with sin_folded = cat(-sin_lo, sin_hi),
    which turns the rotary into Split, Concat, two Muls and an Add.
    """
    half = spec.head_dim // 2
    exponent = np.arange(0, spec.head_dim, 2, dtype=np.int64).astype(np.float32) / spec.head_dim
    inv_freq = (1.0 / (np.float32(spec.rope_theta) ** exponent)).astype(np.float32)  # [half]
    pos = np.arange(spec.max_positions, dtype=np.float32)
    freqs = np.outer(pos, inv_freq).astype(np.float32)  # [max_positions, half]
    emb = np.concatenate([freqs, freqs], axis=-1)  # [max_positions, head_dim]
    cos, sin = np.cos(emb), np.sin(emb)
    sin[:, :half] *= -1.0
    return cos.astype(np.float32), sin.astype(np.float32)


class _ExternalData:
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


class _Graph:
    """Accumulates nodes and initializers; every helper returns its output name."""

    def __init__(self, data: _ExternalData, precision: str) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[TensorProto] = []
        self.precision = precision
        self.int8 = precision != "fp32"  # int8 embedding table and LM head for int4 too
        self._data = data
        self._count = 0

    def op(
        self, op_type: str, inputs: list[str], n_out: int = 1, out: str | None = None, **attrs
    ) -> str | list[str]:
        self._count += 1
        outs = [out] if out else [f"{op_type.lower()}_{self._count}_{i}" for i in range(n_out)]
        name = f"{op_type}_{self._count}"
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=name, **attrs))
        return outs[0] if n_out == 1 else outs

    def const(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(self._data.tensor(name, array))
        return name

    def ints(self, name: str, values: int | list[int]) -> str:
        return self.const(name, np.asarray(values, dtype=np.int64))

    def linear(
        self, x: str, weight: np.ndarray, name: str, out: str | None = None, bits: int = 0
    ) -> str:
        """x @ weight.T for an HF Linear weight [out, in]: fp32 MatMul, or MatMulNBits in
        ``bits`` (default: the graph's precision)."""
        if not self.int8:
            return self.op("MatMul", [x, self.const(f"{name}.weight_t", weight.T)], out=out)
        n, k = weight.shape
        bits = bits or (4 if self.precision == "int4" else 8)
        if bits == 8:
            blocks, scales = quantize_blocks(weight, INT8_BLOCK)  # [n, k/b, b], [n * k/b]
            zero = []
        else:
            blocks, scales, zeros = quantize_blocks_4bit(weight, INT8_BLOCK)
            zero = [self.const(f"{name}.zero_q4", zeros)]
        inputs = [x, self.const(f"{name}.weight_q{bits}", blocks)]
        inputs += [self.const(f"{name}.scale", scales), *zero]
        return self.op(
            "MatMulNBits", inputs, out=out, domain="com.microsoft",
            K=k, N=n, bits=bits, block_size=INT8_BLOCK, accuracy_level=4,
        )  # fmt: skip

    def rms_norm(self, x: str, weight: np.ndarray, name: str, eps: float) -> str:
        # The Pow→ReduceMean→Add→Sqrt→Div→Mul pattern ORT fuses into SimplifiedLayerNormalization.
        sq = self.op("Pow", [x, "c_two"])
        var = self.op("ReduceMean", [sq], axes=[-1], keepdims=1)
        std = self.op("Sqrt", [self.op("Add", [var, self.const(f"{name}.eps", _f32(eps))])])
        return self.op("Mul", [self.op("Div", [x, std]), self.const(f"{name}.weight", weight)])


def _f32(value: float) -> np.ndarray:
    return np.asarray(value, dtype=np.float32)


Weights = Callable[[str], np.ndarray]  # HF tensor name → float32 array


def quantize_blocks(weight: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """MatMulNBits' 8-bit layout: symmetric int8 per block of ``block`` inputs, stored +128.

    weight [n, k] → (uint8 [n, ceil(k/block), block], float32 scales [n * ceil(k/block)]).
    Dequantised: (q - 128) * scale, 128 being the op's default zero point for 8 bits.
    """
    n, k = weight.shape
    n_blocks = -(-k // block)
    padded = np.zeros((n, n_blocks * block), np.float32)
    padded[:, :k] = weight
    padded = padded.reshape(n, n_blocks, block)
    scale = np.abs(padded).max(axis=-1) / 127.0  # [n, n_blocks]
    scale[scale == 0] = 1.0
    q = np.clip(np.rint(padded / scale[..., None]), -127, 127) + 128
    return q.astype(np.uint8), scale.astype(np.float32).reshape(-1)


def quantize_blocks_4bit(
    weight: np.ndarray, block: int, tries: int = 9
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MatMulNBits' 4-bit layout, asymmetric: w ~ scale * (q - zero), q and zero in 0..15.

    weight [n, k] -> (uint8 [n, k/block, block/2]: element 2j low nibble, 2j+1 high;
    float32 scales [n * k/block]; uint8 zero points [n, ceil(k/block / 2)], packed the same).
    Integer zero points keep ORT on its int8-compute kernels (float ones fall back to a path
    ~50x slower). Each block's scale is the least-squares best of ``tries`` around min-max.
    """
    n, k = weight.shape
    if k % block:
        raise ValueError(f"4-bit weights need an input width divisible by {block}, not {k}")
    w = weight.reshape(n, k // block, block).astype(np.float32)
    lo, hi = w.min(axis=-1), w.max(axis=-1)
    span = np.maximum(hi - lo, 1e-12)
    best = (np.full(lo.shape, np.inf, np.float32), None, None, None)
    for factor in np.linspace(0.8, 1.0, tries):  # a narrower grid clips the extremes a little
        scale = span * factor / 15
        zero = np.clip(np.rint(-lo / scale), 0, 15)
        q = np.clip(np.rint(w / scale[..., None] + zero[..., None]), 0, 15)
        err = ((scale[..., None] * (q - zero[..., None]) - w) ** 2).sum(axis=-1)
        better = err < best[0]
        if best[1] is None:
            best = (err, q, scale, zero)
        else:
            best = (
                np.where(better, err, best[0]),
                np.where(better[..., None], q, best[1]),
                np.where(better, scale, best[2]),
                np.where(better, zero, best[3]),
            )
    _, q, scale, zero = best
    q = q.astype(np.uint8)
    packed = q[..., 0::2] | (q[..., 1::2] << 4)  # [n, blocks, block/2]
    z = zero.astype(np.uint8)
    if z.shape[1] % 2:
        z = np.concatenate([z, np.zeros((n, 1), np.uint8)], axis=1)
    zeros = z[:, 0::2] | (z[:, 1::2] << 4)  # [n, ceil(blocks / 2)]
    return packed, scale.astype(np.float32).reshape(-1), zeros


def _attention(g: _Graph, spec: Qwen2Spec, weights: Weights, i: int, h: str, ctx: dict) -> str:
    p = f"model.layers.{i}.self_attn"
    hd, nh, kvh = spec.head_dim, spec.num_heads, spec.num_kv_heads
    scale = np.float32(hd**-0.5)
    w_qkv = np.concatenate([weights(f"{p}.{n}_proj.weight") for n in "qkv"])  # [(nh+2kv)*hd, H]
    w_qkv[: nh * hd] *= scale
    b_qkv = np.concatenate([weights(f"{p}.{n}_proj.bias") for n in "qkv"])
    b_qkv[: nh * hd] *= scale
    qkv = g.linear(h, w_qkv, f"{p}.qkv")
    qkv = g.op("Add", [qkv, g.const(f"{p}.qkv.bias", b_qkv)])  # [1, seq, (nh+2kv)*hd]
    q, k, v = g.op("Split", [qkv, g.ints(f"{p}.split", [nh * hd, kvh * hd, kvh * hd])], 3, axis=-1)
    heads = []
    for name, x, n in (("q", q, nh), ("k", k, kvh), ("v", v, kvh)):
        x = g.op("Reshape", [x, g.ints(f"{p}.{name}_shape", [1, -1, n, hd])])
        heads.append(g.op("Transpose", [x], perm=[0, 2, 1, 3]))  # [1, n, seq, hd]
    q, k, v = heads
    q, k = (_rotary(g, x, ctx) for x in (q, k))
    key = g.op("Concat", [f"past_key.{i}", k], out=f"present_key.{i}", axis=2)  # [1, kv, total, hd]
    value = g.op("Concat", [f"past_value.{i}", v], out=f"present_value.{i}", axis=2)
    q = g.op("Reshape", [q, ctx["q_group_shape"]])  # [1, kv, group*seq, hd]
    scores = g.op("MatMul", [q, g.op("Transpose", [key], perm=[0, 1, 3, 2])])
    probs = g.op("Softmax", [g.op("Add", [scores, ctx["mask"]])], axis=-1)  # [1, kv, g*seq, total]
    out = g.op("MatMul", [probs, value])  # [1, kv, group*seq, hd]
    out = g.op("Reshape", [out, ctx["heads_shape"]])  # [1, nh, seq, hd]
    out = g.op("Transpose", [out], perm=[0, 2, 1, 3])
    out = g.op("Reshape", [out, ctx["merge_shape"]])  # [1, seq, nh*hd]
    return g.linear(out, weights(f"{p}.o_proj.weight"), f"{p}.o")


def _rotary(g: _Graph, x: str, ctx: dict) -> str:
    lo, hi = g.op("Split", [x, ctx["halves"]], 2, axis=-1)
    swapped = g.op("Concat", [hi, lo], axis=-1)
    return g.op("Add", [g.op("Mul", [x, ctx["cos"]]), g.op("Mul", [swapped, ctx["sin"]])])


def _mlp(g: _Graph, spec: Qwen2Spec, weights: Weights, i: int, h: str) -> str:
    p = f"model.layers.{i}.mlp"
    w_gu = np.concatenate([weights(f"{p}.gate_proj.weight"), weights(f"{p}.up_proj.weight")])
    gu = g.linear(h, w_gu, f"{p}.gate_up")  # [1, seq, 2*I]
    size = spec.intermediate_size
    gate, up = g.op("Split", [gu, g.ints(f"{p}.split", [size, size])], 2, axis=-1)
    act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up])  # silu(gate) * up
    return g.linear(act, weights(f"{p}.down_proj.weight"), f"{p}.down")


def _shared_inputs(g: _Graph, spec: Qwen2Spec) -> dict:
    """Per-call tensors every layer reuses: rotary cos/sin, the causal mask, reshape targets."""
    cos_table, sin_table = rope_tables(spec)
    cos = g.op("Gather", [g.const("rope.cos", cos_table), "position_ids"])  # [1, seq, hd]
    sin = g.op("Gather", [g.const("rope.sin", sin_table), "position_ids"])
    ctx = {
        "cos": g.op("Unsqueeze", [cos, g.ints("axis1", [1])]),  # [1, 1, seq, hd]
        "sin": g.op("Unsqueeze", [sin, "axis1"]),
        "halves": g.ints("rope.halves", [spec.head_dim // 2] * 2),
        "q_group_shape": g.ints("q_group_shape", [1, spec.num_kv_heads, -1, spec.head_dim]),
        "heads_shape": g.ints("heads_shape", [1, spec.num_heads, -1, spec.head_dim]),
        "merge_shape": g.ints("merge_shape", [1, -1, spec.num_heads * spec.head_dim]),
    }
    # mask[s, t] = 0 where key t <= query position s, else -inf; positions are absolute.
    past = g.op("Shape", ["past_key.0"], start=2, end=3)
    seq = g.op("Shape", ["input_ids"], start=1, end=2)
    total = g.op("Squeeze", [g.op("Add", [past, seq])])
    keys = g.op("Range", [g.ints("zero", 0), total, g.ints("one", 1)])  # [total]
    query = g.op("Reshape", ["position_ids", g.ints("column", [-1, 1])])  # [seq, 1]
    allowed = g.op("LessOrEqual", [keys, query])  # [seq, total]
    bias = g.op("Where", [allowed, g.const("c_zero", _f32(0.0)), g.const("c_ninf", _f32(-np.inf))])
    ctx["mask"] = g.op("Tile", [bias, g.ints("mask_repeats", [spec.group, 1])])  # [g*seq, total]
    g.const("c_two", _f32(2.0))
    return ctx


def _embedding(g: _Graph, embed: np.ndarray) -> str:
    """Token embedding, [1, seq, hidden]. embed: [vocab, hidden]."""
    if g.int8:
        return _int8_lookup(g, embed)
    return g.op("Gather", [g.const("embed_tokens.weight", embed), "input_ids"])


def _lm_head(g: _Graph, spec: Qwen2Spec, weights: Weights, embed: np.ndarray, x: str, rows) -> None:
    # Tied weights are written twice on purpose: sharing one initializer between the Gather and
    # the MatMul made ORT keep both it and the MatMul's prepacked copy (+544 MB RSS at 0.5B).
    head = embed if spec.tied_embeddings else weights("lm_head.weight")  # [vocab, hidden]
    if rows is not None:  # a draft may propose from part of the vocabulary (export.head_rows)
        head = head[rows]
    g.linear(x, head, "lm_head", out="logits", bits=8)  # logits decide acceptance: 8 bits


def _int8_lookup(g: _Graph, embed: np.ndarray) -> str:
    """Embedding rows as symmetric int8 with one scale per row: a quarter of the fp32 memory."""
    scale = np.maximum(np.abs(embed).max(axis=1, keepdims=True), 1e-12) / 127.0  # [vocab, 1]
    rows = np.rint(embed / scale).astype(np.int8)  # [vocab, hidden]
    x = g.op("Cast", [g.op("Gather", [g.const("embed_tokens.int8", rows), "input_ids"])], to=1)
    row_scale = g.op(
        "Gather", [g.const("embed_tokens.scale", scale.astype(np.float32)), "input_ids"]
    )
    return g.op("Mul", [x, row_scale])  # [1, seq, hidden]


def _io(spec: Qwen2Spec, logits: int) -> tuple[list, list]:
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    kv = [1, spec.num_kv_heads, "past_len", spec.head_dim]
    kv_out = [1, spec.num_kv_heads, "total_len", spec.head_dim]
    inputs = [
        helper.make_tensor_value_info("input_ids", i64, [1, "seq_len"]),
        helper.make_tensor_value_info("position_ids", i64, [1, "seq_len"]),
    ]
    outputs = [helper.make_tensor_value_info("logits", f, [1, "seq_len", logits])]
    for i in range(spec.num_layers):
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_{kind}.{i}", f, kv))
            outputs.append(helper.make_tensor_value_info(f"present_{kind}.{i}", f, kv_out))
    return inputs, outputs


def build_model(
    spec: Qwen2Spec,
    weights: Weights,
    out_path: Path,
    precision: str = "fp32",
    on_layer: Callable[[int, int], None] | None = None,
    head_rows: np.ndarray | None = None,
) -> None:
    """Writes ``out_path`` (graph) and ``out_path.data`` (external weights).

    precision "fp32": every weight fp32. "int8": Linear weights as block-wise int8 MatMulNBits
    (accuracy_level 4: int8 compute), embedding per-row int8; norms, biases, attention fp32.
    "int4": as int8 but the Linears before the LM head in 4-bit blocks.
    ``on_layer(done, total)`` is called after each decoder layer (export progress).
    ``head_rows``: the token ids whose logits the graph computes, in its ``logits`` order
    (None: the whole vocabulary).
    """
    assert precision in ("fp32", "int8", "int4"), precision
    data = _ExternalData(out_path.with_name(out_path.name + ".data"))
    try:
        g = _Graph(data, precision)
        ctx = _shared_inputs(g, spec)
        embed = weights("model.embed_tokens.weight")  # [vocab, hidden]
        x = _embedding(g, embed)  # [1, seq, hidden]
        eps = spec.rms_norm_eps
        for i in range(spec.num_layers):
            p = f"model.layers.{i}"
            h = g.rms_norm(x, weights(f"{p}.input_layernorm.weight"), f"{p}.ln1", eps)
            x = g.op("Add", [x, _attention(g, spec, weights, i, h, ctx)])
            h = g.rms_norm(x, weights(f"{p}.post_attention_layernorm.weight"), f"{p}.ln2", eps)
            x = g.op("Add", [x, _mlp(g, spec, weights, i, h)])
            if on_layer is not None:
                on_layer(i + 1, spec.num_layers)
        x = g.rms_norm(x, weights("model.norm.weight"), "model.norm", eps)
        _lm_head(g, spec, weights, embed, x, head_rows)  # logits [1, seq, vocab or rows]
    finally:
        data.close()
    inputs, outputs = _io(spec, spec.vocab_size if head_rows is None else len(head_rows))
    graph = helper.make_graph(g.nodes, "qwen2_draft", inputs, outputs, g.initializers)
    opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=IR_VERSION)
    model.producer_name = "specsplit"
    onnx.save_model(model, out_path)
