"""Builds the ONNX graph of a decoder-only LM whose KV cache is updated in place, from weights.

Contract (the drafter depends on it; ``edge.models.GRAPH_FORMAT`` changes whenever it does):

    inputs   input_ids         int64    [1, seq]
             past_len          int64    [1]      positions already in the cache
             logits_from       int64    [1]      the first of this call's seq positions whose
                                                 logits are computed, 0 <= logits_from < seq
             past_key.{i}      float32  [1, kv_heads, capacity, head_dim]   the layer's key buffer
             past_value.{i}    float32  [1, kv_heads, capacity, head_dim]
    outputs  logits            float32  [1, seq - logits_from, vocab]
             present_key.{i}   float32  [1, kv_heads, capacity, head_dim]   past_key.{i} with
             present_value.{i} float32  [1, kv_heads, capacity, head_dim]   past_len..+seq written

An LM head split by token frequency (``head_rows``: the export's ``lm_head_ids``) adds

    inputs   rest_from         int64    [1]      the first of the logits positions whose rest
                                                 of the vocabulary is computed too (any value
                                                 >= seq - logits_from: none)
    outputs  logits            float32  [1, seq - logits_from, len(head_rows)]   the head's rows
             logits_rest       float32  [1, rest_len, vocab - len(head_rows)]    every other id,
                                                 rising, for the positions from rest_from on

so a step over frequent text reads the frequent rows alone, and the rest only where the caller
asks (edge.onnx_drafter: once the sequence holds an id outside them). A head part over no
positions is a MatMulNBits of zero rows, which reads none of its weights.

``past_len + seq <= capacity``. The LM head runs on the positions from ``logits_from`` only: a
prompt's prefill passes ``seq - 1`` and gets the one row it samples from ([1, 1, vocab]) instead
of [1, seq, vocab] float32 (151,936 columns at Qwen2.5: 0.6 MB a position, ~10 GB at 8k tokens,
and most of the prefill's time), while a step or a block passes 0 and gets every position's
logits. The caller binds each present_* to the very buffer it binds as
past_* (ONNX Runtime IO binding): ONNX's TensorScatter then writes only the ``seq`` new positions
(ORT skips its copy when input and output alias), so a step never copies the past. Attention
reads the whole buffer with every position after the query's own masked, so whatever lies beyond
``past_len + seq`` (a rolled-back draft, zeros) never counts: rollback is passing a smaller
``past_len``. Without IO binding the graph still computes the same (TensorScatter copies).

The math follows transformers' modeling code of each family (``edge.export.families`` says where
they differ): RMSNorm → q/k/v → (q/k norm) → rotary (rotate_half, partial where the config
says) → grouped-query attention, causal over past+new (sliding window, soft-cap per family) →
o_proj → (norm) → residual → RMSNorm → down(act(gate) * up) → (norm) → residual; final norm;
lm_head (soft-capped for Gemma 2). Graph-level choices, all exact rewrites:
- q/k/v and gate/up projections are fused into one MatMul each (fewer kernels per token).
- Rotary is ONNX's RotaryEmbedding with cos/sin computed in the graph from the positions
  (cos(position * inv_freq), as transformers computes them): no tables of max_positions rows.
- GQA without repeat_kv: q is reshaped to [1, kv_heads, group*seq, head_dim] so each kv head
  multiplies its whole query group at once (one GEMM reading the cache once per kv head).
- Large tensors are written as ONNX external data (the real models exceed protobuf's 2 GB).

Why not com.microsoft GroupQueryAttention, which shares past/present too: on this CPU (one
thread, Qwen2.5-0.5B shapes: 14 heads, 2 kv heads) its decode step costs ~400 us a layer at
2,000 positions against ~175 us for TensorScatter + the grouped MatMuls here (it multiplies
each query head separately), so the whole draft step was 10-15% slower at that context; and its
CUDA kernel takes fp16/bf16 only, which would leave this fp32-activation graph's attention on
the CPU. Both matched transformers on the tiny models to fp32 rounding.

Precision "int8" is quantised here, not by a separate pass: every Linear becomes com.microsoft
MatMulNBits (8-bit weights, symmetric, one scale per block of ``onnx_quant.DEFAULT_BLOCK`` inputs
unless the export chooses another; accuracy_level 4 lets ORT quantise activations per block too and
use int8 dot products), the embedding a per-row int8 table. Norms, biases, rotary and attention stay
fp32. Measured on Qwen2.5-Coder-0.5B this is ~10x closer to fp32 logits than onnxruntime's
quantize_dynamic (per-tensor activation scales), at about the same speed. Precision "int4" makes
every Linear but the LM head 4-bit MatMulNBits (asymmetric blocks with integer zero points: float
zero points, which could hold a Q4_K group exactly, send ORT to a ~50x slower kernel); the LM head
stays int8 by default, its logits being what the draft is judged by (4 bits: an export option).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from specsplit.edge.export.families import ModelSpec
from specsplit.edge.export.onnx_builder import ExternalData, GraphBuilder, f32
from specsplit.edge.export.onnx_quant import DEFAULT_BLOCK

log = logging.getLogger(__name__)

OPSET = 24  # TensorScatter (the in-place KV write) is opset 24; RotaryEmbedding 23, Gelu 20
IR_VERSION = 10  # ONNX Runtime rejects the newest IR versions onnx writes by default

Weights = Callable[[str], np.ndarray]  # HF tensor name → float32 array


def _norm(g: GraphBuilder, spec: ModelSpec, x: str, weights: Weights, name: str) -> str:
    """RMSNorm with the checkpoint's weight ``name`` (Gemma's ``1 + w``, as it computes it)."""
    weight = weights(f"{name}.weight")
    if spec.gemma_norms:
        weight = np.float32(1.0) + weight
    return g.rms_norm(x, weight, name, spec.rms_norm_eps)


def _head_norm(g: GraphBuilder, spec: ModelSpec, x: str, heads: int, w: Weights, name: str) -> str:
    """RMSNorm of every head of x [1, seq, heads*hd] over its head_dim (Qwen3, Gemma 3)."""
    x4 = g.op("Reshape", [x, g.ints(f"bsnh{heads}", [1, -1, heads, spec.head_dim])])
    return g.op("Reshape", [_norm(g, spec, x4, w, name), g.ints("flat3", [1, 0, -1])])


def _qkv(g: GraphBuilder, spec: ModelSpec, weights: Weights, p: str, h: str) -> list[str]:
    """q [1, seq, nh*hd], k and v [1, seq, kv*hd] from one fused projection."""
    hd, nh, kvh = spec.head_dim, spec.num_heads, spec.num_kv_heads
    if spec.fused_projections:
        w_qkv = weights(f"{p}.qkv_proj.weight")  # [(nh+2kv)*hd, H], q rows first
    else:
        w_qkv = np.concatenate([weights(f"{p}.{n}_proj.weight") for n in "qkv"])
    bias = np.concatenate([weights(f"{p}.{n}_proj.bias") for n in "qkv"]) if spec.qkv_bias else None
    qkv = g.linear(h, w_qkv, f"{p}.qkv", bias=bias)  # [1, seq, (nh+2kv)*hd]
    split = g.ints(f"split_qkv{nh}_{kvh}", [nh * hd, kvh * hd, kvh * hd])
    return g.op("Split", [qkv, split], 3, axis=-1)


def _attention(
    g: GraphBuilder, spec: ModelSpec, weights: Weights, i: int, h: str, ctx: dict
) -> str:
    p = f"model.layers.{i}.self_attn"
    hd, nh, kvh = spec.head_dim, spec.num_heads, spec.num_kv_heads
    q, k, v = _qkv(g, spec, weights, p, h)
    if spec.qk_norm:  # before rotary, as Qwen3 and Gemma 3 do
        q = _head_norm(g, spec, q, nh, weights, f"{p}.q_norm")
        k = _head_norm(g, spec, k, kvh, weights, f"{p}.k_norm")
    kind = spec.rope_kinds[i]
    rope = spec.ropes[kind]
    partial = {"rotary_embedding_dim": rope.rotary_dim} if rope.rotary_dim < hd else {}
    heads = []
    for x, n, rotate in ((q, nh, True), (k, kvh, True), (v, kvh, False)):
        if rotate:  # on [1, seq, n*hd]: the op splits the heads itself
            cos_sin = [ctx[f"cos.{kind}"], ctx[f"sin.{kind}"]]
            x = g.op("RotaryEmbedding", [x, *cos_sin], num_heads=n, **partial)
        x = g.op("Reshape", [x, g.ints(f"bsnh{n}", [1, -1, n, hd])])  # [1, seq, n, hd]
        heads.append(g.op("Transpose", [x], perm=[0, 2, 1, 3]))  # [1, n, seq, hd]
    q, k, v = heads
    # In place when present_* is bound to the past_* buffer: only positions past_len.. written.
    key = g.op("TensorScatter", [f"past_key.{i}", k, "past_len"], out=f"present_key.{i}", axis=2)
    value = g.op(
        "TensorScatter", [f"past_value.{i}", v, "past_len"], out=f"present_value.{i}", axis=2
    )  # [1, kv, capacity, hd] each
    q = g.op("Reshape", [q, ctx["q_group_shape"]])  # [1, kv, group*seq, hd]
    scores = g.op("MatMul", [q, g.op("Transpose", [key], perm=[0, 1, 3, 2])])
    scores = g.op("Mul", [scores, g.const("attn_scale", f32(spec.attn_scale))])
    if spec.attn_softcap:  # softcap * tanh(scores / softcap), before the mask, as Gemma 2
        cap = g.const("attn_softcap", f32(spec.attn_softcap))
        scores = g.op("Mul", [g.op("Tanh", [g.op("Div", [scores, cap])]), cap])
    mask = ctx[f"mask.{spec.windows[i]}"]
    probs = g.op("Softmax", [g.op("Add", [scores, mask])], axis=-1)  # [1, kv, g*seq, cap]
    out = g.op("MatMul", [probs, value])  # [1, kv, group*seq, hd]
    out = g.op("Reshape", [out, ctx["heads_shape"]])  # [1, nh, seq, hd]
    out = g.op("Transpose", [out], perm=[0, 2, 1, 3])
    out = g.op("Reshape", [out, ctx["merge_shape"]])  # [1, seq, nh*hd]
    bias = weights(f"{p}.o_proj.bias") if spec.o_bias else None
    return g.linear(out, weights(f"{p}.o_proj.weight"), f"{p}.o", bias=bias)


def _mlp(g: GraphBuilder, spec: ModelSpec, weights: Weights, i: int, h: str) -> str:
    p = f"model.layers.{i}.mlp"
    if spec.fused_projections:
        w_gu = weights(f"{p}.gate_up_proj.weight")  # [2*I, H], gate rows first
    else:
        w_gu = np.concatenate([weights(f"{p}.gate_proj.weight"), weights(f"{p}.up_proj.weight")])
    b = (lambda n: weights(f"{p}.{n}_proj.bias")) if spec.mlp_bias else None
    bias = np.concatenate([b("gate"), b("up")]) if b else None
    gu = g.linear(h, w_gu, f"{p}.gate_up", bias=bias)  # [1, seq, 2*I]
    size = spec.intermediate_size
    gate, up = g.op("Split", [gu, g.ints(f"split_mlp{size}", [size, size])], 2, axis=-1)
    if spec.activation == "gelu_tanh":
        act = g.op("Gelu", [gate], approximate="tanh")
    else:
        act = g.op("Mul", [gate, g.op("Sigmoid", [gate])])  # silu
    down = weights(f"{p}.down_proj.weight")
    return g.linear(g.op("Mul", [act, up]), down, f"{p}.down", bias=b("down") if b else None)


def _layer(g: GraphBuilder, spec: ModelSpec, weights: Weights, i: int, x: str, ctx: dict) -> str:
    p = f"model.layers.{i}"
    attn = _attention(g, spec, weights, i, _norm(g, spec, x, weights, f"{p}.input_layernorm"), ctx)
    if spec.gemma_norms:  # Gemma: the attention and MLP outputs are normed too
        attn = _norm(g, spec, attn, weights, f"{p}.post_attention_layernorm")
        pre_mlp = f"{p}.pre_feedforward_layernorm"
    else:  # elsewhere "post_attention_layernorm" is the norm before the MLP
        pre_mlp = f"{p}.post_attention_layernorm"
    x = g.op("Add", [x, attn])
    mlp = _mlp(g, spec, weights, i, _norm(g, spec, x, weights, pre_mlp))
    if spec.gemma_norms:
        mlp = _norm(g, spec, mlp, weights, f"{p}.post_feedforward_layernorm")
    return g.op("Add", [x, mlp])


def _rotary_inputs(g: GraphBuilder, spec: ModelSpec, positions: str) -> dict:
    """cos and sin [1, seq, rotary_dim/2] of each rotary kind at this call's positions: freqs =
    position * inv_freq in float32, then cos/sin (times the scaling), as transformers computes."""
    column = g.op("Unsqueeze", [positions, g.ints("ax1", [1])])  # [seq, 1]
    column_f = g.op("Cast", [column], to=TensorProto.FLOAT)
    ctx = {}
    for kind, rope in spec.ropes.items():
        inv = g.const(f"rope.{kind}.inv_freq", np.asarray(rope.inv_freq, np.float32))
        freqs = g.op("Mul", [column_f, inv])  # [seq, rotary/2]
        if rope.long_inv_freq is not None:  # LongRoPE: long factors from long_from on
            long_inv = g.const(
                f"rope.{kind}.long_inv_freq", np.asarray(rope.long_inv_freq, np.float32)
            )
            use_long = g.op(
                "GreaterOrEqual", [column, g.ints(f"rope.{kind}.long_from", [rope.long_from])]
            )
            freqs = g.op("Where", [use_long, g.op("Mul", [column_f, long_inv]), freqs])
        for name, op in (("cos", "Cos"), ("sin", "Sin")):
            y = g.op(op, [freqs])
            if rope.scaling != 1.0:
                y = g.op("Mul", [y, g.const(f"rope.{kind}.scaling", f32(rope.scaling))])
            ctx[f"{name}.{kind}"] = g.op("Unsqueeze", [y, g.ints("ax0", [0])])
    return ctx


def _shared_inputs(g: GraphBuilder, spec: ModelSpec) -> dict:
    """Per-call tensors every layer reuses: rotary cos/sin, the masks, reshape targets."""
    seq = g.op("Shape", ["input_ids"], start=1, end=2)  # [1]
    start, end = g.op("Squeeze", ["past_len"]), g.op("Squeeze", [g.op("Add", ["past_len", seq])])
    positions = g.op("Range", [start, end, g.ints("one", 1)])  # [seq]: past_len .. total-1
    ctx = _rotary_inputs(g, spec, positions)
    ctx["q_group_shape"] = g.ints("q_group_shape", [1, spec.num_kv_heads, -1, spec.head_dim])
    ctx["heads_shape"] = g.ints("heads_shape", [1, spec.num_heads, -1, spec.head_dim])
    ctx["merge_shape"] = g.ints("merge_shape", [1, -1, spec.num_heads * spec.head_dim])
    # mask[s, t] = 0 where query s may see key t (t <= s; t > s - window), else -inf, over the
    # buffer's whole capacity: what lies past the query never counts
    capacity = g.op("Squeeze", [g.op("Shape", ["past_key.0"], start=2, end=3)])
    keys = g.op("Range", [g.ints("zero", 0), capacity, "one"])  # [capacity]
    query = g.op("Unsqueeze", [positions, "ax1"])  # [seq, 1]
    causal = g.op("LessOrEqual", [keys, query])  # [seq, capacity]
    zero, ninf = g.const("c_zero", f32(0.0)), g.const("c_ninf", f32(-np.inf))
    for window in sorted(set(spec.windows), key=lambda w: w or 0):
        allowed = causal
        if window is not None:
            oldest = g.op("Sub", [query, g.ints(f"window{window}", window - 1)])
            allowed = g.op("And", [causal, g.op("GreaterOrEqual", [keys, oldest])])
        bias = g.op("Where", [allowed, zero, ninf])
        # rows of q are (head within group, position): the mask repeats once per head
        ctx[f"mask.{window}"] = g.op("Tile", [bias, g.ints("mask_repeats", [spec.group, 1])])
    return ctx


def _embedding(g: GraphBuilder, spec: ModelSpec, embed: np.ndarray) -> str:
    """Token embedding, [1, seq, hidden]. embed: [vocab, hidden]."""
    scale = None if spec.embed_scale is None else np.float32(spec.embed_scale)
    if g.int8:
        return _int8_lookup(g, embed, scale)
    if scale is not None:  # Gemma: embed * sqrt(hidden), the same float32 product per element
        embed = embed * scale
    if g.half:  # a float16 table (half the memory), its rows cast up as they are looked up
        rows = g.op("Gather", [g.const("embed_tokens.fp16", embed.astype(np.float16)), "input_ids"])
        return g.op("Cast", [rows], to=TensorProto.FLOAT)
    return g.op("Gather", [g.const("embed_tokens.weight", embed), "input_ids"])


def _lm_head(
    g: GraphBuilder,
    spec: ModelSpec,
    weights: Weights,
    embed: np.ndarray,
    x: str,
    rows,
    bits: int,
    name: str = "lm_head",
    out: str = "logits",
) -> None:
    """``out`` = the LM head's ``rows`` (None: all) applied to x (soft-capped for Gemma 2)."""
    # Tied weights are written twice on purpose: sharing one initializer between the Gather and
    # the MatMul made ORT keep both it and the MatMul's prepacked copy (+544 MB RSS at 0.5B).
    head = embed if spec.tied_embeddings else weights("lm_head.weight")  # [vocab, hidden]
    if rows is not None:  # a draft's head split by frequency (export.head_rows)
        head = head[rows]
    cap = spec.final_softcap
    logits = g.linear(x, head, name, out=None if cap else out, bits=bits)
    if cap:  # Gemma 2: cap * tanh(logits / cap)
        c = g.const("final_softcap", f32(cap))
        g.op("Mul", [g.op("Tanh", [g.op("Div", [logits, c])]), c], out=out)


def _int8_lookup(g: GraphBuilder, embed: np.ndarray, scale: np.float32 | None) -> str:
    """Embedding rows as symmetric int8 with one scale per row: a quarter of the fp32 memory."""
    row_scale = np.maximum(np.abs(embed).max(axis=1, keepdims=True), 1e-12) / 127.0  # [vocab, 1]
    rows = np.rint(embed / row_scale).astype(np.int8)  # [vocab, hidden]
    if scale is not None:
        row_scale = row_scale * scale
    x = g.op("Cast", [g.op("Gather", [g.const("embed_tokens.int8", rows), "input_ids"])], to=1)
    row_scale = g.op(
        "Gather", [g.const("embed_tokens.scale", row_scale.astype(np.float32)), "input_ids"]
    )
    return g.op("Mul", [x, row_scale])  # [1, seq, hidden]


def _io(spec: ModelSpec, logits: int, rest: int = 0) -> tuple[list, list]:
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    kv = [1, spec.num_kv_heads, "capacity", spec.head_dim]  # past and present: one buffer
    inputs = [
        helper.make_tensor_value_info("input_ids", i64, [1, "seq_len"]),
        helper.make_tensor_value_info("past_len", i64, [1]),
    ]
    inputs.append(helper.make_tensor_value_info("logits_from", i64, [1]))
    outputs = [helper.make_tensor_value_info("logits", f, [1, "logits_len", logits])]
    if rest:  # a split head (module docstring)
        inputs.append(helper.make_tensor_value_info("rest_from", i64, [1]))
        outputs.append(helper.make_tensor_value_info("logits_rest", f, [1, "rest_len", rest]))
    for i in range(spec.num_layers):
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_{kind}.{i}", f, kv))
            outputs.append(helper.make_tensor_value_info(f"present_{kind}.{i}", f, kv))
    return inputs, outputs


def build_model(
    spec: ModelSpec,
    weights: Weights,
    out_path: Path,
    precision: str = "fp32",
    on_layer: Callable[[int, int], None] | None = None,
    head_rows: np.ndarray | None = None,
    block: int = DEFAULT_BLOCK,
    head_bits: int = 8,
) -> None:
    """Writes ``out_path`` (graph) and ``out_path.data`` (external weights).

    precision "fp32": every weight fp32. "int8": Linear weights as block-wise int8 MatMulNBits
    (accuracy_level 4: int8 compute), embedding per-row int8; norms, biases, attention fp32.
    "int4": as int8 but the Linears before the LM head in 4-bit blocks.
    "fp16" and "int4-fp16": as "fp32" and "int4", every Linear computed in float16 (the
    embedding table too, for "fp16"); the residual stream, norms, rotary, attention and the KV
    cache stay float32, so the graph's inputs and outputs are those of the others.
    ``on_layer(done, total)`` is called after each decoder layer (export progress).
    ``head_rows``: the token ids of ``logits``, in its order, rising (None: the whole
    vocabulary); every other id then goes to ``logits_rest``, computed on demand (module
    docstring). ``block``: inputs per weight scale of every MatMulNBits;
    ``head_bits``: the LM head's (8 or 4) where the precision quantises.
    """
    assert precision in ("fp32", "int8", "int4", "fp16", "int4-fp16"), precision
    if head_bits not in (4, 8):
        raise ValueError(f"head_bits must be 4 or 8, not {head_bits}")
    data = ExternalData(out_path.with_name(out_path.name + ".data"))
    try:
        g = GraphBuilder(data, precision, block)
        ctx = _shared_inputs(g, spec)
        embed = weights("model.embed_tokens.weight")  # [vocab, hidden]
        x = _embedding(g, spec, embed)  # [1, seq, hidden]
        for i in range(spec.num_layers):
            x = _layer(g, spec, weights, i, x, ctx)
            if on_layer is not None:
                on_layer(i + 1, spec.num_layers)
        x = _norm(g, spec, x, weights, "model.norm")  # [1, seq, hidden]
        # the positions whose logits are asked for: [1, seq - logits_from, hidden]
        x = g.op("Slice", [x, "logits_from", g.ints("int64_max", [2**63 - 1]), g.ints("ax1", [1])])
        _lm_head(g, spec, weights, embed, x, head_rows, head_bits)  # [1, logits_len, rows]
        rest = None if head_rows is None else np.setdiff1d(np.arange(spec.vocab_size), head_rows)
        if rest is not None:  # the other ids, for the positions from rest_from on
            end, ax1 = g.ints("int64_max", [2**63 - 1]), g.ints("ax1", [1])
            x_rest = g.op("Slice", [x, "rest_from", end, ax1])  # [1, rest_len, hidden]
            names = ("lm_head_rest", "logits_rest")
            _lm_head(g, spec, weights, embed, x_rest, rest, head_bits, *names)
    finally:
        data.close()
    rows = spec.vocab_size if head_rows is None else len(head_rows)
    inputs, outputs = _io(spec, rows, 0 if rest is None else len(rest))
    graph = helper.make_graph(g.nodes, f"{spec.family}_draft", inputs, outputs, g.initializers)
    opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=IR_VERSION)
    model.producer_name = "specsplit"
    onnx.save_model(model, out_path)
