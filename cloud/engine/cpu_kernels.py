"""The target's batch-invariant CPU kernels (``cpu_*.c`` beside this file) as Python calls:
the parameter structs of ``cpu_kernels.h`` in ctypes, and one function (or class) per kernel
call, which checks its tensors and hands C their memory. ``cloud.engine.kernel_library`` builds
and loads the library these call.

Why our own kernels: torch's weight-only int8/int4 kernels cost in proportion to the rows (a
verify block of 9 rows costs 3-5x one row), and none of torch's matmuls promise that a row's
result is independent of the other rows in the call. These read each weight once per pass for
every row (memory-bound, like llama.cpp's), quantise activations to int8 per 32 values, and
compute every output element by one fixed sequence of operations (the C file's contract;
``kernel_layouts.reference_gemm``), so a row's logits never depend on the batch.

Two matmul kernels compute that same product: AVX2 (``vpmaddubsw``, any x86-64 of the last
decade) and AVX-512 VNNI (``vpdpbusd``, 16 output columns a vector: about 4x fewer instructions
per extra row, so a verify block costs much less than its rows' one-row steps).
``kernel_library.backend()`` picks the best the CPU has; their results are bit for bit the
same, so a target on one CPU answers as it does on another.
"""

from __future__ import annotations

import ctypes
import itertools

import torch

from specsplit.cloud.engine import decoder, kernel_layouts, kernel_library
from specsplit.cloud.engine.kernel_layouts import (
    GROUP,
    PAIR,
    KernelWeights,
    check_width,
    paired,
    per_block,
)

__all__ = ["GROUP", "PAIR", "KernelWeights", "check_width", "paired", "per_block"]  # re-exported

_P, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


# The header's parameter structs (cpu_kernels.h), field for field; a struct is passed by
# pointer (ctypes.byref), so cloud.engine.kernel_library's prototypes read it as a pointer.
class Rows(ctypes.Structure):  # specsplit_rows
    _fields_ = [
        ("m", _I64),
        ("k", _I64),
        ("xq", _P),
        ("xs", _P),
        ("xsum", _P),
        ("xsum16", _P),  # q6_k's scratch, else None
    ]


class Weights(ctypes.Structure):  # specsplit_weights: our int8 / int4
    _fields_ = [("n", _I64), ("q", _P), ("sc", _P), ("d", _P), ("mn", _P), ("dm", _P)]


class KQuantWeights(ctypes.Structure):  # specsplit_kq_weights
    _fields_ = [
        ("fmt", ctypes.c_int32),
        ("n", _I64),
        ("ql", _P),
        ("qh", _P),
        ("sc", _P),
        ("d", _P),
        ("mn", _P),
        ("dm", _P),
    ]


class BlockWeights(ctypes.Structure):  # specsplit_block_weights
    _fields_ = [("fmt", ctypes.c_int32), ("n", _I64), ("v", _P), ("high", _P), ("d", _P)]


class Segments(ctypes.Structure):  # specsplit_segments
    _fields_ = [
        ("count", _I64),
        ("slot", _P),
        ("cap", _P),
        ("start", _P),
        ("len", _P),
        ("row0", _P),
    ]


class AttentionArgs(ctypes.Structure):  # specsplit_attention_args
    _fields_ = [
        ("q", _P),
        ("k_new", _P),
        ("v_new", _P),
        ("heads", _I64),
        ("kv_heads", _I64),
        ("head_dim", _I64),
        ("layer", _I64),
        ("scale", _F32),
        ("window", _I64),
        ("softcap", _F32),
    ]


class Heads(ctypes.Structure):  # specsplit_heads
    _fields_ = [
        ("x", _P),
        ("rows", _I64),
        ("stride", _I64),
        ("heads", _I64),
        ("head_stride", _I64),
        ("dim", _I64),
    ]


class ResidualArgs(ctypes.Structure):  # specsplit_residual_args
    _fields_ = [("x", _P), ("y", _P), ("m", _I64), ("k", _I64), ("w", _P), ("eps", _F32)]


STRUCTS = {
    "specsplit_rows": Rows,
    "specsplit_weights": Weights,
    "specsplit_kq_weights": KQuantWeights,
    "specsplit_block_weights": BlockWeights,
    "specsplit_segments": Segments,
    "specsplit_attention_args": AttentionArgs,
    "specsplit_heads": Heads,
    "specsplit_residual_args": ResidualArgs,
}


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def fits(config) -> bool:
    """Whether every projection of the decoder reads rows the kernels take, and its heads are
    a whole number of 16-value steps (the attention and rotary kernels'), and its MLP activation
    one they compute (``activation_kind``): so that a calibration never picks a format whose
    engine would refuse the model."""
    head_dim = decoder.head_dim(config)
    widths = (config.hidden_size, config.intermediate_size, config.num_attention_heads * head_dim)
    shapes = head_dim % 16 == 0 and all(w % PAIR == 0 for w in widths)
    return shapes and _computes_activation(config)


class QuantizedRows:
    """Activations quantised to int8, one scale per super-block: ``x ~ xs * xq``; built once
    per input and shared by every matmul that reads it. xq is in the layout of ``backend``
    (``paired`` for avx2, natural otherwise)."""

    def __init__(
        self,
        x: torch.Tensor,
        norm: tuple[torch.Tensor, float] | None = None,
        kernel: str | None = None,
    ):
        """x [M, K] float32; ``norm`` = (weight [K] float32, eps): quantise RMSNorm(x) instead
        (Llama's and Qwen2's: ``w * x / sqrt(mean(x^2) + eps)``), fused in one pass."""
        x = x.contiguous()
        self.rows, self.k = x.shape
        check_width(self.k)
        self.backend = kernel or kernel_library.backend()
        groups = self.k // GROUP
        self.xq = torch.empty((self.rows, self.k), dtype=torch.int8)
        self.xs = torch.empty((self.rows, groups // per_block(self.k)), dtype=torch.float32)
        self.xsum = torch.empty((self.rows, groups), dtype=torch.int16)
        out = (ctypes.byref(self.c_rows()), self.paired, _threads())
        if norm is None:
            kernel_library.library().specsplit_quantize_rows(_ptr(x), *out)
        else:
            weight, eps = norm
            if weight.dtype != torch.float32 or weight.shape != (self.k,):
                raise ValueError("the norm's weight must be float32 of the rows' width")
            weight = weight.contiguous()  # held: C reads it (a temporary's pointer would dangle)
            kernel_library.library().specsplit_rmsnorm_quantize(_ptr(x), _ptr(weight), eps, *out)

    @property
    def paired(self) -> int:
        """1: xq in the paired layout (the AVX2 kernels'), 0: natural order."""
        return 1 if self.backend == "avx2" else 0

    def c_rows(self, xsum16: torch.Tensor | None = None) -> Rows:
        """These rows as the kernels read them (``specsplit_rows``); ``xsum16``: q6_k's work
        buffer, held by the caller for the call."""
        scratch = None if xsum16 is None else _ptr(xsum16)
        return Rows(self.rows, self.k, _ptr(self.xq), _ptr(self.xs), _ptr(self.xsum), scratch)


def pack(bits: int, tensors: tuple[torch.Tensor, ...], kernel: str | None = None) -> KernelWeights:
    """Natural-layout weights (``cloud.engine.quantized``) in the layout of ``kernel``
    [``kernel_library.backend()``]."""
    return kernel_layouts.pack(kernel or kernel_library.backend(), bits, tensors)


def gemm(x: QuantizedRows, w: KernelWeights) -> torch.Tensor:
    """[M, N] = x @ w.T, w in the layout of x's kernel (``kernel_layouts.pack``)."""
    if w.backend != x.backend or w.k != x.k:
        raise ValueError(f"weights for {w.backend} x {w.k} given rows for {x.backend} x {x.k}")
    out = torch.empty((x.rows, w.n), dtype=torch.float32)
    q, sc, d, *offsets = w.tensors
    mn, dm = (_ptr(t) for t in offsets) if offsets else (None, None)
    weights = Weights(w.n, _ptr(q), _ptr(sc), _ptr(d), mn, dm)
    lib = kernel_library.library()
    fn = lib.specsplit_gemm if w.backend == "avx2" else lib.specsplit_gemm_vnni
    fn(ctypes.byref(x.c_rows()), ctypes.byref(weights), _ptr(out), _threads())
    return out


class RaggedBatch:
    """A ragged pass's segments as the attention kernel reads them, built once per pass and
    read by every layer: each segment's whole KV slot (``[layers, 2, kv_heads, capacity,
    head_dim]`` float32, already reserved for the pass), where its new rows go and how many."""

    def __init__(self, slots: list[torch.Tensor], starts: list[int], lengths: list[int]):
        for kv in slots:
            if not kv.is_contiguous() or kv.dtype != torch.float32:
                raise ValueError("KV slots must be contiguous float32")
        n = len(slots)
        i64 = ctypes.c_int64 * n
        self.slots = slots  # held: the kernel writes into their memory
        self.count = n
        self.bases = (ctypes.c_void_p * n)(*[kv.data_ptr() for kv in slots])
        self.capacities = i64(*[kv.shape[3] for kv in slots])
        self.starts, self.lengths = i64(*starts), i64(*lengths)
        self.row0 = i64(*list(itertools.accumulate(lengths, initial=0))[:n])
        arrays = (self.bases, self.capacities, self.starts, self.lengths, self.row0)
        self.c_segments = Segments(n, *(ctypes.addressof(a) for a in arrays))


def attention(
    q: torch.Tensor,  # [R, H, D] float32, rotated
    k: torch.Tensor,  # [R, KVH, D] float32, rotated
    v: torch.Tensor,  # [R, KVH, D]
    batch: RaggedBatch,
    layer: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Writes each segment's new keys/values of ``layer`` into its slot, then returns the
    causal attention of every row over its own session's positions ``0..start + i`` (the last
    ``window`` of them with a sliding window), scores soft-capped at ``softcap`` if given."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # held: C reads their memory
    rows, heads, dim = q.shape
    out = torch.empty_like(q)
    args = AttentionArgs(
        _ptr(q), _ptr(k), _ptr(v), heads, k.shape[1], dim, layer, scale, window or 0, softcap or 0.0
    )
    failed = kernel_library.library().specsplit_attention(
        ctypes.byref(args), ctypes.byref(batch.c_segments), _ptr(out), _threads()
    )
    if failed:
        raise MemoryError("the attention kernel could not allocate its scratch memory")
    return out


def rope(x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotates, in place, the first ``heads`` heads of each row of ``x`` [R, width] float32
    (Llama's "rotate half" rotary embedding) over their first ``cos.shape[1]`` values (all of
    a head, or part: partial rotary); cos/sin [R, rotary dims] float32."""
    rows, width = x.shape
    rot = cos.shape[-1]
    if not x.is_contiguous() or x.dtype != torch.float32 or heads * head_dim > width:
        raise ValueError("rope needs contiguous float32 rows holding the heads")
    if rot % 16 or rot > head_dim or cos.shape != (rows, rot) or sin.shape != (rows, rot):
        raise ValueError("rope needs rotary dims % 16 == 0, <= head_dim, cos/sin [rows, dims]")
    cos, sin = cos.float().contiguous(), sin.float().contiguous()  # held: C reads them
    vectors = Heads(_ptr(x), rows, width, heads, head_dim, rot)
    kernel_library.library().specsplit_rope(ctypes.byref(vectors), _ptr(cos), _ptr(sin))


def _threads() -> int:
    return torch.get_num_threads()


# Row-wise ops (cpu_rowwise.c): the float work between two kernels, each output element by one
# fixed sequence of operations on its own row, so that no torch elementwise op (whose vector
# body, scalar tail and thread split move with the batch) stands between two kernels.

ACTIVATIONS = ("silu", "gelu_tanh")  # act(gate) * up, by cpu_rowwise.c's number (index)


def activation_kind(act) -> str:
    """The name in ``ACTIVATIONS`` of a decoder's MLP activation (``decoder.mlp_activation``:
    a transformers ``ACT2FN`` module or a torch function); ValueError for any other, so that a
    model is refused at load rather than computed wrongly."""
    from transformers import activations as hf

    silu = (torch.nn.SiLU, hf.SiLUActivation)
    gelu_tanh = tuple(
        getattr(hf, n)
        for n in ("GELUTanh", "PytorchGELUTanh", "NewGELUActivation", "FastGELUActivation")
        if hasattr(hf, n)
    )
    if isinstance(act, silu) or act is torch.nn.functional.silu:
        return "silu"
    if isinstance(act, gelu_tanh) or (isinstance(act, torch.nn.GELU) and act.approximate == "tanh"):
        return "gelu_tanh"
    raise ValueError(
        f"the CPU kernels compute the MLP activations {ACTIVATIONS}, not {act!r} "
        "(serve this model with --weights float)"
    )


def _gate_up(gate_up: torch.Tensor, act: str) -> tuple[torch.Tensor, int, int]:
    """Checks gate_up [M, 2F] float32 (gate | up, F a multiple of 64) -> (contiguous, F, act)."""
    if gate_up.dtype != torch.float32 or gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be float32 [rows, 2F], got {gate_up.dtype} {gate_up.shape}")
    if act not in ACTIVATIONS:
        raise ValueError(f"activation {act!r} is not one of {ACTIVATIONS}")
    f = gate_up.shape[1] // 2
    check_width(f)
    return gate_up.contiguous(), f, ACTIVATIONS.index(act)


def act_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up in float32 [M, F], gate_up [M, 2F] = (gate | up): the values
    ``ActivatedRows`` quantises (for tests and for a float path)."""
    gu, f, kind = _gate_up(gate_up, act)
    out = torch.empty((gu.shape[0], f), dtype=torch.float32)
    kernel_library.library().specsplit_act_mul(
        _ptr(gu), gu.shape[0], f, kind, _ptr(out), _threads()
    )
    return out


class ActivatedRows(QuantizedRows):
    """``QuantizedRows`` of act(gate) * up, gate_up [M, 2F] = (gate | up) float32, computed and
    quantised in one C call (``cpu_rowwise.c``): bit for bit ``QuantizedRows(act_mul(...))``,
    without the float product ever reaching torch."""

    def __init__(self, gate_up: torch.Tensor, act: str, kernel: str | None = None):
        gu, f, kind = _gate_up(gate_up, act)
        self.rows, self.k = gu.shape[0], f
        self.backend = kernel or kernel_library.backend()
        groups = f // GROUP
        self.xq = torch.empty((self.rows, f), dtype=torch.int8)
        self.xs = torch.empty((self.rows, groups // per_block(f)), dtype=torch.float32)
        self.xsum = torch.empty((self.rows, groups), dtype=torch.int16)
        kernel_library.library().specsplit_act_mul_quantize(
            _ptr(gu), kind, ctypes.byref(self.c_rows()), self.paired, _threads()
        )


def _norm_weight(norm: tuple[torch.Tensor, float]) -> tuple[torch.Tensor, float]:
    """(weight [D], eps) of an RMSNorm (``decoder.rms_norm_params``), checked for C."""
    weight, eps = norm
    if weight.dtype != torch.float32 or weight.dim() != 1 or not weight.is_contiguous():
        raise ValueError("the norm's weight must be a contiguous float32 vector")
    if weight.shape[0] % 8:
        raise ValueError(
            f"the row-wise kernels normalise vectors of 8k values, not {weight.shape[0]}"
        )
    return weight, float(eps)


def rms_norm(
    x: torch.Tensor, norm: tuple[torch.Tensor, float], out: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm of each D-long vector of x [M, H * D] float32 (rows of any stride, values
    contiguous: e.g. the q heads of a fused q/k/v output), D = the weight's size, a multiple of
    8: ``w * (v * (1 / sqrt(mean(v^2) + eps)))``. Into ``out`` (same shape; ``out=x``: in place),
    else a new tensor."""
    weight, eps = _norm_weight(norm)
    d = weight.shape[0]
    if x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1 or x.shape[1] % d:
        raise ValueError(f"rms_norm needs float32 rows [M, heads * {d}], values contiguous")
    if out is None:
        out = torch.empty(x.shape, dtype=torch.float32)
    elif out.shape != x.shape or out.dtype != torch.float32 or out.stride(1) != 1:
        raise ValueError("out must be float32 of x's shape, its values contiguous")
    vectors = Heads(_ptr(x), x.shape[0], x.stride(0), x.shape[1] // d, d, d)
    kernel_library.library().specsplit_rmsnorm(
        ctypes.byref(vectors), _ptr(weight), eps, _ptr(out), out.stride(0), _threads()
    )
    return out


def residual_add(
    x: torch.Tensor,
    branch: torch.Tensor,
    norm: tuple[torch.Tensor, float] | None = None,
    in_place: bool = False,
) -> torch.Tensor:
    """x + branch, or x + RMSNorm(branch) (Gemma's post norms), [M, K] float32, K % 8 == 0:
    a new tensor, or x itself (``in_place``, x contiguous)."""
    if x.dtype != torch.float32 or branch.dtype != torch.float32 or x.shape != branch.shape:
        raise ValueError("residual_add needs float32 x and branch of one shape")
    if x.dim() != 2 or x.shape[1] % 8:
        raise ValueError(f"residual_add needs [rows, K] with K % 8 == 0, got {tuple(x.shape)}")
    if in_place and not x.is_contiguous():
        raise ValueError("residual_add in place needs contiguous rows")
    x, branch = x.contiguous(), branch.contiguous()  # held: C reads them
    weight, eps = (None, 0.0) if norm is None else _norm_weight(norm)
    if weight is not None and weight.shape[0] != x.shape[1]:
        raise ValueError(f"the norm's weight has {weight.shape[0]} values, the rows {x.shape[1]}")
    out = x if in_place else torch.empty(x.shape, dtype=torch.float32)
    w = None if weight is None else _ptr(weight)
    args = ResidualArgs(_ptr(x), _ptr(branch), x.shape[0], x.shape[1], w, eps)
    kernel_library.library().specsplit_residual_add(ctypes.byref(args), _ptr(out), _threads())
    return out


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap) elementwise (``decoder.soft_cap``'s), new float32; x as is if no cap."""
    if cap is None:
        return x
    if x.dtype != torch.float32 or not cap > 0:
        raise ValueError(f"soft_cap needs float32 values and a cap > 0, got {x.dtype}, {cap}")
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32)
    kernel_library.library().specsplit_soft_cap(
        _ptr(x), x.numel(), float(cap), _ptr(out), _threads()
    )
    return out


def _computes_activation(config) -> bool:
    """Whether the kernels compute the activation the config names (Gemma's
    ``hidden_activation``, else ``hidden_act``), as ``activation_kind`` judges its module."""
    from transformers.activations import ACT2FN

    name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    try:
        activation_kind(ACT2FN[name])
    except (KeyError, ValueError):
        return False
    return True
