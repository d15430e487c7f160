"""GGUF K-quant weights (Q4_K, Q5_K, Q6_K) at their own widths, on the CPU kernels.

A K-quant row is cut into super-blocks of 256 values with a float16 scale ``d`` (and, for
Q4_K/Q5_K, a float16 ``dmin``), each holding small integer sub-block scales (``gguf.quants``'
``Q4_K``, ``Q5_K`` and ``Q6_K`` decode them, and document each block's bits). The weights:
- q4_k: ``w = d * sc[g] * q - dmin * mn[g]``, q in [0, 15], sc and mn 6-bit per 32 values;
- q5_k: the same with q in [0, 31];
- q6_k: ``w = d * sc[j] * (q - 32)``, q in [0, 63], sc int8 per 16 values.

Natural layout (what ``from_gguf`` makes and a cache keeps; the source's values exactly, within
3% of its bytes), ``G = K / 32`` groups, ``B = K / 256`` super-blocks:
- q4_k: ``(packed [N, K/2] uint8, sc [N, G] uint8, d [N, B] float16, mn [N, G] uint8,
  dm [N, B] float16)``; ``packed`` is ``kernel_layouts``' int4 layout (byte j of a group: element
  j in the low nibble, j + 16 in the high one);
- q5_k: ``(packed, high [N, K/8] uint8, sc, d, mn, dm)``; ``high`` byte i bit t is bit 4 of
  element 8i + t;
- q6_k: ``(packed, high [N, K/4] uint8, sc [N, K/16] int8, d [N, B] float16)``; ``packed`` holds
  the low 4 bits of q, ``high`` byte i bits 2t..2t+1 the top 2 bits of element 4i + t.

The canonical product (``reference_gemm``; ``cpu_kquants.c`` computes it bit for bit) is the one
of ``kernel_layouts`` with K-quant containers: per super-block b the exact integer sums
``S = sum_j sc[n, j] * sum_k q[n, k] xq[r, k]`` (q signed: Q6_K's q - 32) and
``M = sum_g mn[n, g] * xsum[r, g]``, then in float32, for b in order,
``a = a + (float)S * (d * xs)``, ``o = o + (float)M * (dm * xs)``; ``out = a - o``. d and dm
widen exactly from float16, so Q4_K gives the bits of ``kernel_layouts.reference_gemm`` of the
same values in its int4 containers.

``pack`` makes each kernel's layout (``cpu_kquants.c`` describes them); ``gemm`` runs it on the
rows of a ``cpu_kernels.QuantizedRows``.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import numpy as np
import torch

from specsplit.cloud.engine import cpu_kernels as kernels
from specsplit.cloud.engine import kernel_library
from specsplit.cloud.engine.kernel_layouts import (
    BACKENDS,
    GROUP,
    LANES,
    KernelWeights,
    int4_levels,
    paired,
)

FORMATS = ("q4_k", "q5_k", "q6_k")
SUPER = 256  # values per super-block (ggml's QK_K)
GGUF_BLOCK_BYTES = {"q4_k": 144, "q5_k": 176, "q6_k": 210}  # a GGUF block of 256 values
GGUF_BYTES_PER_WEIGHT = {f: b / SUPER for f, b in GGUF_BLOCK_BYTES.items()}
# what the natural layout and both kernels' layouts hold (and a one-row pass reads) per weight:
# the GGUF's bytes plus, for q4_k/q5_k, 8 bytes a super-block for uint8 scales and mins
# instead of ggml's 12 packed 6-bit ones (+2.8%, +2.3%); q6_k's exactly
BYTES_PER_WEIGHT = {"q4_k": 148 / SUPER, "q5_k": 180 / SUPER, "q6_k": 210 / SUPER}
LOCAL_SUMS = 8192  # cpu_kquants.c's KQ_LOCAL_SUMS: Q6_K's activation sums on the C stack
_CODE = {f: i for i, f in enumerate(FORMATS)}  # the C side's fmt argument
_LEVEL_BITS = {"q4_k": 4, "q5_k": 5, "q6_k": 6}


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown K-quant format {fmt!r}; one of {FORMATS}")


# ---- GGUF blocks -> natural layout ---------------------------------------------------------


def _scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[n, 12] packed 6-bit scales and mins of Q4_K/Q5_K -> two [n, 8] uint8 (ggml's
    ``get_scale_min_k4``)."""
    d, m, m_d = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _pack_levels(levels: torch.Tensor) -> torch.Tensor:
    """[N, K] levels (low 4 bits used) -> [N, K/2] int4 natural layout."""
    n, k = levels.shape
    g = (levels & 15).reshape(n, k // GROUP, GROUP)
    return (g[..., : GROUP // 2] | (g[..., GROUP // 2 :] << 4)).reshape(n, k // 2).contiguous()


def _pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[N, K] values below 2**bits -> [N, K * bits / 8] uint8, byte i holding elements
    (8 / bits) i + t at bit t * bits."""
    n, k = values.shape
    per = 8 // bits
    v = values.to(torch.uint8).reshape(n, k // per, per)
    out = torch.zeros((n, k // per), dtype=torch.uint8)
    for t in range(per):
        out |= v[..., t] << (t * bits)
    return out


def _unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    n, nbytes = packed.shape
    per = 8 // bits
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
    return ((packed[..., None] >> shifts) & ((1 << bits) - 1)).reshape(n, nbytes * per)


def from_gguf(fmt: str, raw: np.ndarray) -> tuple[torch.Tensor, ...]:
    """raw [N, row_bytes] uint8, a GGUF tensor's blocks (``gguf.GGUFReader(...).tensors[i].data``)
    -> the natural layout (module docstring)."""
    _check_format(fmt)
    raw = np.ascontiguousarray(raw)
    size = GGUF_BLOCK_BYTES[fmt]
    if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[1] % size:
        raise ValueError(
            f"{fmt} rows must be uint8 [N, a multiple of {size} bytes], not {raw.dtype} {raw.shape}"
        )
    n = raw.shape[0]
    blocks = raw.reshape(-1, size)  # [N * B, size]
    nb = blocks.shape[0]
    if fmt == "q6_k":
        ql, qh = blocks[:, :128], blocks[:, 128:192]
        sc = blocks[:, 192:208].view(np.int8)
        d = blocks[:, 208:210].view(np.float16)
        # ggml: element 128h + 32s + i: low 4 bits from ql[64h + 32 (s % 2) + i] >> 4 (s // 2),
        # top 2 bits from qh[32h + i] >> 2s
        lo = (ql.reshape(nb, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15
        hi = (qh.reshape(nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
        q = lo.reshape(nb, SUPER) | (hi.reshape(nb, SUPER) << 4)
        q = torch.from_numpy(q.reshape(n, -1))
        return (
            _pack_levels(q),
            _pack_bits(q >> 4, 2),
            torch.from_numpy(sc.reshape(n, -1).copy()),
            torch.from_numpy(d.reshape(n, -1).copy()),
        )
    d = blocks[:, 0:2].view(np.float16)
    dmin = blocks[:, 2:4].view(np.float16)
    sc, mn = _scale_min(blocks[:, 4:16])
    qs = blocks[:, -128:]  # element 64c + 32h + i: qs[32c + i] >> 4h
    q = (qs.reshape(nb, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15
    q = q.reshape(nb, SUPER)
    if fmt == "q5_k":  # bit 4 of element 32s + i: qh[i] >> s
        qh = blocks[:, 16:48]
        bit = (qh.reshape(nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
        q = q | (bit.reshape(nb, SUPER) << 4)
    q = torch.from_numpy(np.ascontiguousarray(q).reshape(n, -1))
    planes = (_pack_levels(q),) + ((_pack_bits(q >> 4, 1),) if fmt == "q5_k" else ())
    return (
        *planes,
        torch.from_numpy(sc.reshape(n, -1).copy()),
        torch.from_numpy(d.reshape(n, -1).copy()),
        torch.from_numpy(mn.reshape(n, -1).copy()),
        torch.from_numpy(dmin.reshape(n, -1).copy()),
    )


def check(fmt: str, tensors: tuple[torch.Tensor, ...]) -> tuple[int, int]:
    """(N, K) of natural-layout tensors of ``fmt`` (a cache may hand in anything); raises
    ValueError naming the first tensor of the wrong dtype or shape."""
    _check_format(fmt)
    if not tensors or tensors[0].dim() != 2:
        raise ValueError(f"{fmt}: the first tensor must be the [N, K/2] low-bit plane")
    n, k = tensors[0].shape[0], 2 * tensors[0].shape[1]
    if k % SUPER:
        raise ValueError(f"{fmt} rows of {k} values: not whole super-blocks of {SUPER}")
    u8, i8, f16 = torch.uint8, torch.int8, torch.float16
    scales = [("sc", u8, GROUP), ("d", f16, SUPER), ("mn", u8, GROUP), ("dm", f16, SUPER)]
    want = {
        "q4_k": [("packed", u8, 2), *scales],
        "q5_k": [("packed", u8, 2), ("high", u8, 8), *scales],
        "q6_k": [("packed", u8, 2), ("high", u8, 4), ("sc", i8, 16), ("d", f16, SUPER)],
    }[fmt]
    if len(tensors) != len(want):
        raise ValueError(
            f"{fmt} takes {len(want)} tensors ({[w[0] for w in want]}), not {len(tensors)}"
        )
    for t, (name, dtype, per) in zip(tensors, want, strict=True):
        if t.dtype != dtype or tuple(t.shape) != (n, k // per):
            raise ValueError(
                f"{fmt} {name}: {t.dtype} {tuple(t.shape)}, expected {dtype} {(n, k // per)}"
            )
    return n, k


def levels(fmt: str, tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Natural layout -> [N, K] unsigned levels q (uint8; Q6_K's before its - 32)."""
    check(fmt, tensors)
    q = int4_levels(tensors[0])
    if fmt == "q5_k":
        q = q | (_unpack_bits(tensors[1], 1) << 4)
    elif fmt == "q6_k":
        q = q | (_unpack_bits(tensors[1], 2) << 4)
    return q


def _parts(fmt: str, tensors: tuple[torch.Tensor, ...]):
    """(levels, sc, d, mn, dm); mn and dm None for Q6_K."""
    if fmt == "q6_k":
        _, _, sc, d = tensors
        return levels(fmt, tensors), sc, d, None, None
    sc, d, mn, dm = tensors[-4:]
    return levels(fmt, tensors), sc, d, mn, dm


def nbytes(tensors: tuple[torch.Tensor, ...]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def dequantize(fmt: str, tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """[N, K] float32, each value as ``gguf.quants.dequantize`` computes it from the blocks
    (``(d * sc) * q - dmin * mn``, every product rounded to float32)."""
    q, sc, d, mn, dm = _parts(fmt, tensors)
    n, k = q.shape
    if fmt == "q6_k":
        step = d.float().repeat_interleave(16, dim=1) * sc.float()  # [N, K/16]
        return (step[..., None] * (q.float() - 32).reshape(n, -1, 16)).reshape(n, k)
    step = d.float().repeat_interleave(8, dim=1) * sc.float()  # [N, G]
    low = dm.float().repeat_interleave(8, dim=1) * mn.float()
    return (step[..., None] * q.float().reshape(n, -1, GROUP) - low[..., None]).reshape(n, k)


def reference_gemm(
    fmt: str,
    xq: torch.Tensor,  # [M, K] int8, natural order
    xs: torch.Tensor,  # [M, B] float32
    xsum: torch.Tensor,  # [M, G] int16
    tensors: tuple[torch.Tensor, ...],  # natural layout
) -> torch.Tensor:
    """[M, N]: the canonical product (module docstring), in torch."""
    q, sc, d, mn, dm = _parts(fmt, tensors)
    m, k = xq.shape
    n = q.shape[0]
    blocks = k // SUPER
    chunk = 16 if fmt == "q6_k" else GROUP  # values per sub-block scale
    signed = q.double() - (32 if fmt == "q6_k" else 0)
    # exact integers: float64 holds every partial sum here (< 2^31) without rounding
    dots = torch.einsum(
        "mck,nck->mnc",
        xq.double().reshape(m, k // chunk, chunk),
        signed.reshape(n, k // chunk, chunk),
    )
    s = (dots * sc.double()[None]).reshape(m, n, blocks, -1).sum(-1).float()  # [M, N, B]
    a = torch.zeros((m, n), dtype=torch.float32)
    o = torch.zeros((m, n), dtype=torch.float32)
    if mn is not None:
        o_sums = (mn.double()[None] * xsum.double()[:, None]).reshape(m, n, blocks, -1).sum(-1)
        o_sums = o_sums.float()
    for b in range(blocks):
        dx = xs[:, b : b + 1].float()  # [M, 1]
        a = a + s[..., b] * (d[:, b].float()[None] * dx)
        if mn is not None:
            o = o + o_sums[..., b] * (dm[:, b].float()[None] * dx)
    return a - o


# ---- kernel layouts ---------------------------------------------------------------------------


@dataclass(frozen=True)
class KQuantWeights(KernelWeights):
    """``KernelWeights`` of a K-quant format (``format``; ``bits`` is its level width): only
    ``gemm`` here reads them, never ``cpu_kernels.gemm``."""

    # the C struct pointing into ``tensors`` (which hold its memory): made from them on every
    # construction, ``dataclasses.replace`` included (the target moves packed weights into
    # huge pages that way), so it never points at tensors that were let go
    c_weights: object = field(init=False, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "c_weights", _c_weights(self.format, self.n, self.tensors))


def _blocks(t: torch.Tensor, n: int) -> torch.Tensor:
    """[N, ...] -> [N / 16, 16, ...], N padded to whole blocks of 16 with zeros."""
    pad = -n % LANES
    if pad:
        t = torch.cat([t, t.new_zeros((pad, *t.shape[1:]))])
    return t.reshape(-1, LANES, *t.shape[1:])


def _pack_avx2(fmt: str, tensors, q: torch.Tensor) -> tuple[torch.Tensor, ...]:
    n, k = q.shape
    blocks = k // SUPER
    # 32-value chunks c of a super-block in the activations' paired order: [N, B, 8, 32]
    chunks = paired(q).reshape(n, blocks, 8, 32)
    if fmt == "q6_k":
        packed, _, sc, d = tensors
        top = (chunks >> 4).reshape(n, blocks, 2, 4, 32)  # vector u, shift 2s
        high = sum(top[:, :, :, s] << (2 * s) for s in range(4)).to(torch.uint8)
        # chunk c = 2v + h holds natural 16-value chunks 4v + h (low lane), 4v + 2 + h (high)
        order = [4 * (c // 2) + c % 2 + 2 * lane for lane in range(2) for c in range(8)]
        sc = sc.reshape(n, blocks, 16)[..., order]
        return packed, high.reshape(n, -1), sc.reshape(n, -1), d
    if fmt == "q5_k":
        bit = (chunks >> 4) & 1
        high = sum(bit[:, :, c] << c for c in range(8)).to(torch.uint8)  # [N, B, 32]
        return (tensors[0], high.reshape(n, -1), *tensors[2:])
    return tuple(tensors)


def _operands(q: torch.Tensor, n: int) -> torch.Tensor:
    """[N, K] levels -> [N / 16, G, 8, 16, 4]: per group, operand j lane n byte t = element
    4j + t of column n (vpdpbusd's four bytes a lane)."""
    k = q.shape[1]
    b = _blocks(q, n).reshape(-1, LANES, k // GROUP, 8, 4)
    return b.permute(0, 2, 3, 1, 4)


def _pack_vnni(fmt: str, tensors, q: torch.Tensor) -> tuple[torch.Tensor, ...]:
    n, k = q.shape
    ops = _operands(q, n)  # [NB, G, 8, 16, 4]
    low = ops & 15
    ql = low[:, :, 0::2] | (low[:, :, 1::2] << 4)  # vector i: operands 2i (low), 2i + 1 (high)

    def super_scales(d: torch.Tensor) -> torch.Tensor:  # [N, B] -> [NB, B, 16]
        return _blocks(d, n).permute(0, 2, 1)

    if fmt == "q6_k":
        _, _, sc, d = tensors
        top = (ops >> 4).reshape(*ops.shape[:2], 2, 4, LANES, 4)  # vector u, shift 2s
        high = sum(top[:, :, :, s] << (2 * s) for s in range(4)).to(torch.uint8)
        return ql, high, _blocks(sc, n).permute(0, 2, 1), super_scales(d)

    def pairs(s: torch.Tensor) -> torch.Tensor:  # [N, G] -> [NB, G / 2, 16, 2]
        b = _blocks(s, n)
        return b.reshape(b.shape[0], LANES, -1, 2).permute(0, 2, 1, 3)

    sc, d, mn, dm = tensors[-4:]
    scales = (pairs(sc), super_scales(d), pairs(mn), super_scales(dm))
    if fmt == "q5_k":
        bit = (ops >> 4) & 1
        high = sum(bit[:, :, j] << j for j in range(8)).to(torch.uint8)  # [NB, G, 16, 4]
        return ql, high, *scales
    return ql, *scales


def pack(fmt: str, backend: str, tensors: tuple[torch.Tensor, ...]) -> KQuantWeights:
    """Natural layout -> the layout of ``backend`` ("avx2" or "avx512vnni")."""
    q = levels(fmt, tensors)  # checks the tensors
    n, k = q.shape
    if backend == "avx2":
        packed = _pack_avx2(fmt, tensors, q)
    elif backend == "avx512vnni":
        packed = _pack_vnni(fmt, tensors, q)
    else:
        raise ValueError(f"unknown kernel backend {backend!r}; one of {BACKENDS}")
    tensors = tuple(t.contiguous() for t in packed)
    return KQuantWeights(backend, _LEVEL_BITS[fmt], n, k, tensors, fmt)


def _c_weights(fmt: str, n: int, tensors: tuple[torch.Tensor, ...]) -> kernels.KQuantWeights:
    ql, *rest = tensors
    qh = rest.pop(0) if fmt != "q4_k" else None
    sc, d, *offsets = rest
    high = None if qh is None else qh.data_ptr()
    weights = kernels.KQuantWeights(_CODE[fmt], n, ql.data_ptr(), high)
    weights.sc, weights.d = sc.data_ptr(), d.data_ptr()
    if offsets:
        weights.mn, weights.dm = offsets[0].data_ptr(), offsets[1].data_ptr()
    return weights


# ---- the matmul -------------------------------------------------------------------------------


def gemm(fmt: str, x: kernels.QuantizedRows, w: KQuantWeights) -> torch.Tensor:
    """[M, N] = x @ w.T, w in the layout of x's kernel (``pack``)."""
    _check_format(fmt)
    if not isinstance(w, KQuantWeights) or w.format != fmt:
        raise ValueError(f"gemm of {fmt} given {getattr(w, 'format', 'non-K-quant')} weights")
    if w.backend != x.backend or w.k != x.k:
        raise ValueError(f"weights for {w.backend} x {w.k} given rows for {x.backend} x {x.k}")
    out = torch.empty((x.rows, w.n), dtype=torch.float32)
    scratch = None
    if fmt == "q6_k" and x.rows * x.k // 16 > LOCAL_SUMS:  # else the kernel's stack holds them
        scratch = torch.empty((x.rows, x.k // 16), dtype=torch.int32)
    rows = x.c_rows(scratch)
    weights = w.c_weights
    lib = kernel_library.library()
    fn = lib.specsplit_kq_gemm if w.backend == "avx2" else lib.specsplit_kq_gemm_vnni
    fn.restype = ctypes.c_int
    if fn(ctypes.byref(rows), ctypes.byref(weights), out.data_ptr(), torch.get_num_threads()):
        raise RuntimeError(f"{fn.__name__}: no work buffer for {x.rows} rows of {x.k}")
    return out
