"""GGUF's block-32 weight formats (Q8_0, Q5_0, Q4_0) served at their own widths on our kernels.

Each format stores, per group of 32 weights along the input dimension, a float16 scale ``d``
and 32 levels: ``w = d * v`` with v = q (q8_0, int8), u - 16 (q5_0, u in [0, 31]) or u - 8
(q4_0, u in [0, 15]). ``gguf.quants`` documents the blocks.

The natural layout (``from_gguf`` makes it from the file's blocks, keeping every bit of them and
no more bytes), with G = K / 32:
- q8_0: ``(q [N, K] int8, d [N, G] float16)``;
- q5_0: ``(qs [N, K / 2] uint8, qh [N, K / 8] uint8, d [N, G] float16)``: byte j of a group's 16
  in qs holds the low 4 bits of u of element j (low nibble) and j + 16 (high nibble), as in
  GGUF and as ``kernel_layouts``' int4; qh is GGUF's 32-bit little-endian mask per group: bit
  b of the group's byte i is the high bit (16) of u of element 8i + b;
- q4_0: ``(qs [N, K / 2] uint8, d [N, G] float16)``, qs as q5_0's.

``pack`` puts them in a kernel's "columns" layout and ``gemm`` runs ``cpu_block_quants.c``;
``reference_gemm`` is the canonical product of these formats (that file's header) in torch,
which both kernels equal bit for bit.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from specsplit.cloud.engine import cpu_kernels, kernel_library
from specsplit.cloud.engine.kernel_layouts import (
    GROUP,
    KernelWeights,
    check_width,
    int4_levels,
    per_block,
)

FORMATS = ("q8_0", "q5_0", "q4_0")  # the order is cpu_block_quants.c's enum block_format
BLOCK_BYTES = {"q8_0": 2 + GROUP, "q5_0": 2 + 4 + GROUP // 2, "q4_0": 2 + GROUP // 2}
BYTES_PER_WEIGHT = {f: b / GROUP for f, b in BLOCK_BYTES.items()}  # 8.5, 5.5 and 4.5 bits
BIAS = {"q8_0": 0, "q5_0": 16, "q4_0": 8}  # v = u - bias for the stored levels u
BITS = {"q8_0": 8, "q5_0": 5, "q4_0": 4}  # KernelWeights.bits of a packed block-32 tensor
# bytes per column and group in each stream of a packed tensor: values, [high bits,] scales
STREAM_BYTES = {"q8_0": (GROUP, 2), "q5_0": (GROUP // 2, 4, 2), "q4_0": (GROUP // 2, 2)}
LANES = {"avx2": 8, "avx512vnni": 16}  # output columns per vector in each kernel's layout


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown block-32 format {fmt!r}; one of {FORMATS}")


def from_gguf(fmt: str, raw: np.ndarray) -> tuple[torch.Tensor, ...]:
    """GGUF blocks ``raw`` [N, row_bytes] uint8 (``gguf.GGUFReader(...).tensors[i].data``) ->
    the natural layout (the module's docstring)."""
    _check_format(fmt)
    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8 or raw.ndim != 2:
        raise ValueError(f"{fmt} blocks must be a 2-D uint8 array [rows, bytes per row]")
    n, row_bytes = raw.shape
    size = BLOCK_BYTES[fmt]
    if row_bytes == 0 or row_bytes % size:
        raise ValueError(f"{fmt} rows of {row_bytes} bytes: not whole blocks of {size} bytes")
    groups = row_bytes // size
    blocks = np.ascontiguousarray(raw).reshape(n, groups, size)
    d = np.ascontiguousarray(blocks[..., :2]).view(np.float16).reshape(n, groups)
    if not np.isfinite(d).all():
        bad = np.argwhere(~np.isfinite(d))[0]
        raise ValueError(f"{fmt} block (row {bad[0]}, group {bad[1]}) has a non-finite scale")
    d = torch.from_numpy(d.copy())
    body = blocks[..., 2:]
    if fmt == "q8_0":
        q = torch.from_numpy(body.reshape(n, groups * GROUP).view(np.int8).copy())
        return q, d
    if fmt == "q5_0":
        qh = torch.from_numpy(body[..., :4].reshape(n, groups * 4).copy())
        qs = torch.from_numpy(body[..., 4:].reshape(n, groups * GROUP // 2).copy())
        return qs, qh, d
    return torch.from_numpy(body.reshape(n, groups * GROUP // 2).copy()), d


def _bits(qh: torch.Tensor) -> torch.Tensor:
    """[N, K / 8] uint8 -> [N, K] uint8 in {0, 1}: bit b of byte i is element 8i + b."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((qh[..., None] >> shifts) & 1).reshape(qh.shape[0], -1)


def levels(fmt: str, tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """[N, K] int16: the stored level of each weight (q for q8_0, u for q5_0 and q4_0)."""
    _check_format(fmt)
    if fmt == "q8_0":
        return tensors[0].to(torch.int16)
    u = int4_levels(tensors[0]).to(torch.int16)
    if fmt == "q5_0":
        u = u | (_bits(tensors[1]).to(torch.int16) << 4)
    return u


def values(fmt: str, tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """[N, K] int16: each weight's signed value v (w = d * v)."""
    return levels(fmt, tensors) - BIAS[fmt]


def dequantize(fmt: str, tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """[N, K] float32 = d * v, as ``gguf.quants.dequantize`` of the same blocks."""
    v = values(fmt, tensors)
    n, k = v.shape
    d = tensors[-1].float()[..., None]  # [N, G, 1], widened exactly
    return (v.float().reshape(n, k // GROUP, GROUP) * d).reshape(n, k)


def reference_gemm(
    fmt: str,
    xq: torch.Tensor,  # [M, K] int8, natural order
    xs: torch.Tensor,  # [M, B] float32, one scale per super-block of per_block(K) groups
    xsum: torch.Tensor,  # [M, G] int16 (the kernels' bias correction: not in the product)
    tensors: tuple[torch.Tensor, ...],  # natural layout
) -> torch.Tensor:
    """[M, N]: the canonical product of block-32 formats (cpu_block_quants.c's header)."""
    m, k = xq.shape
    groups = k // GROUP
    assert xsum.shape == (m, groups)
    p = per_block(k)
    v = values(fmt, tensors)
    n = v.shape[0]
    # exact integers: float64 holds every group's sum (|S| < 2^20) without rounding
    s = torch.einsum(
        "mgk,ngk->mng",
        xq.double().reshape(m, groups, GROUP),
        v.double().reshape(n, groups, GROUP),
    ).float()  # [M, N, G]
    d = tensors[-1].float()  # [N, G]
    a = torch.zeros((m, n), dtype=torch.float32)
    for g in range(groups):
        dx = d[None, :, g] * xs[:, g // p : g // p + 1].float()  # [M, N]
        a = a + s[..., g] * dx
    return a


def _blocks(t: torch.Tensor, lanes: int) -> torch.Tensor:
    """[N, ...] -> [N / lanes, lanes, ...], padding N with zero columns."""
    pad = -t.shape[0] % lanes
    if pad:
        t = torch.cat([t, t.new_zeros((pad, *t.shape[1:]))])
    return t.reshape(-1, lanes, *t.shape[1:])


def pack(fmt: str, backend: str, tensors: tuple[torch.Tensor, ...]) -> KernelWeights:
    """Natural-layout weights -> the columns layout of ``backend`` (cpu_block_quants.c)."""
    _check_format(fmt)
    if backend not in LANES:
        raise ValueError(f"unknown kernel backend {backend!r}; one of {tuple(LANES)}")
    _check_natural(fmt, tensors)
    lanes = LANES[backend]
    d = tensors[-1]
    n, groups = d.shape
    k = groups * GROUP
    check_width(k)
    u = _blocks(levels(fmt, tensors), lanes).reshape(-1, lanes, groups, 8, 4)  # [NB, L, G, j, t]
    if fmt == "q8_0":
        v = u.permute(0, 2, 3, 1, 4)  # [NB, G, j, L, t]
        v = (v + 128).to(torch.uint8) if backend == "avx512vnni" else v.to(torch.int8)
        streams = [v]
    else:
        low = (u & 15).to(torch.uint8).reshape(-1, lanes, groups, 4, 2, 4)  # [.., i, half, t]
        nib = low[..., 0, :] | (low[..., 1, :] << 4)  # element 8i + t low, 8i + 4 + t high
        streams = [nib.permute(0, 2, 3, 1, 4)]  # [NB, G, i, L, t]
        if fmt == "q5_0":
            streams.append(_high_bits(backend, (u >> 4).to(torch.int64)))
    streams.append(_blocks(d, lanes).permute(0, 2, 1))  # [NB, G, L] float16
    return KernelWeights(backend, BITS[fmt], n, k, tuple(t.contiguous() for t in streams))


def _high_bits(backend: str, high: torch.Tensor) -> torch.Tensor:
    """q5_0's high bits [NB, L, G, j, t] (element 4j + t of each column) -> the kernel's stream:
    avx2 [NB, G, L] int32, bit 8t + j; avx512vnni [NB, G, j * 8] uint8, the bytes of a 64-bit
    mask per vector j, bit 4n + t (cpu_block_quants.c's header)."""
    if backend == "avx2":
        place = 8 * torch.arange(4)[None, :] + torch.arange(8)[:, None]  # [j, t]: bit 8t + j
        word = (high << place).sum((-2, -1))  # [NB, L, G] < 2^32
        word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
        return word.permute(0, 2, 1)
    nb, lanes, groups = high.shape[:3]
    bits = high.permute(0, 2, 3, 1, 4).reshape(nb, groups, 8, lanes * 4 // 8, 8)  # [.., byte, bit]
    return (bits << torch.arange(8)).sum(-1).to(torch.uint8).reshape(nb, groups, -1)


def _check_natural(fmt: str, tensors: tuple[torch.Tensor, ...]) -> None:
    """Shapes and dtypes of a natural layout, checked before any pointer reaches C."""
    d = tensors[-1] if tensors else None
    if d is None or d.dtype != torch.float16 or d.dim() != 2:
        raise ValueError(f"{fmt}: the last tensor must be the [N, G] float16 scales")
    n, groups = d.shape
    k = groups * GROUP
    want = {
        "q8_0": [((n, k), torch.int8)],
        "q5_0": [((n, k // 2), torch.uint8), ((n, k // 8), torch.uint8)],
        "q4_0": [((n, k // 2), torch.uint8)],
    }[fmt]
    got = [(tuple(t.shape), t.dtype) for t in tensors[:-1]]
    if got != want:
        raise ValueError(f"{fmt} natural layout for d {tuple(d.shape)}: want {want}, got {got}")


def gemm(fmt: str, x: cpu_kernels.QuantizedRows, w: KernelWeights) -> torch.Tensor:
    """[M, N] = x @ w.T for ``fmt`` weights packed (``pack``) for x's kernel."""
    _check_format(fmt)
    if w.backend != x.backend or w.k != x.k or w.bits != BITS[fmt]:
        raise ValueError(
            f"{fmt} gemm: weights ({w.backend}, {w.bits} bits, k={w.k}) do not match "
            f"rows for {x.backend} x {x.k}"
        )
    columns = -(-w.n // LANES[w.backend]) * LANES[w.backend]  # padded to whole blocks
    expected = [columns * (w.k // GROUP) * b for b in STREAM_BYTES[fmt]]
    got = [t.numel() * t.element_size() for t in w.tensors]
    if got != expected or not all(t.is_contiguous() for t in w.tensors):
        raise ValueError(f"{fmt} weights of {got} bytes per stream, want {expected}")
    out = torch.empty((x.rows, w.n), dtype=torch.float32)
    lib = kernel_library.library()
    fn = lib.specsplit_block_gemm if w.backend == "avx2" else lib.specsplit_block_gemm_vnni
    high = w.tensors[1].data_ptr() if fmt == "q5_0" else None
    weights = cpu_kernels.BlockWeights(
        FORMATS.index(fmt), w.n, w.tensors[0].data_ptr(), high, w.tensors[-1].data_ptr()
    )
    rows = ctypes.byref(x.c_rows())
    fn(rows, ctypes.byref(weights), out.data_ptr(), torch.get_num_threads())
    return out
