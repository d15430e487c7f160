"""The quantised weights as each matmul kernel reads them, and the product they all compute.

``cloud.engine.quantized`` makes weights in the natural layout (the canonical one, kept in the
quantised-weights cache whatever the CPU):
- int8: ``(q [N, K] int8, sc [N, G] uint8, d [N, B] float32)``;
- int4: ``(packed [N, K / 2] uint8, sc [N, G] int16, d [N, B], mn [N, G] int16, dm [N, B])``,
  byte j of a group holding element j in its low nibble and j + 16 in its high one.

``pack`` turns them into the layout of one kernel (``cpu_kernels.c`` describes both):
- ``avx2``: int8 q in the "paired" order of its 32-byte loads, the rest as is;
- ``avx512vnni``: blocks of 16 output columns, one 32-bit lane per column (N padded to whole
  blocks with zero weights, which add exact zeros).

``reference_gemm`` is the canonical product in torch: exact integer sums per super-block, then
one fixed sequence of float32 operations. Every kernel must equal it bit for bit, which makes
every row's result independent of the batch, the thread count and the kernel the CPU runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 32  # values per quantisation group, along the input dimension
PAIR = 2 * GROUP  # the kernels read groups in pairs: input dimensions are multiples of this
LANES = 16  # output columns per AVX-512 vector
BACKENDS = ("avx2", "avx512vnni")


def check_width(k: int) -> None:
    """Raises ValueError unless the kernels can read rows of ``k`` values."""
    if k % PAIR:
        raise ValueError(f"input dimension {k} is not a multiple of {PAIR} (the CPU kernels')")


def per_block(k: int) -> int:
    """Groups per super-block for rows of ``k`` values (as the C side computes it)."""
    groups = k // GROUP
    return next(p for p in (8, 4, 2) if groups % p == 0)


def paired(t: torch.Tensor) -> torch.Tensor:
    """[..., K] in natural order <-> the AVX2 kernel's paired layout, either way: each pair of
    groups as [g 0..15 | g+1 0..15 | g 16..31 | g+1 16..31]."""
    *lead, k = t.shape
    check_width(k)
    halves = t.reshape(*lead, k // PAIR, 2, 2, GROUP // 2)  # [pairs, group, half, 16]
    return halves.transpose(-3, -2).reshape(*lead, k).contiguous()


def int4_levels(packed: torch.Tensor) -> torch.Tensor:
    """[N, K / 2] packed int4 (natural) -> [N, K] levels in [0, 15], uint8."""
    n = packed.shape[0]
    groups = packed.reshape(n, -1, GROUP // 2)
    return torch.cat([groups & 15, groups >> 4], dim=-1).reshape(n, -1)


@dataclass(frozen=True)
class KernelWeights:
    """One matmul's weights in a kernel's layout: ``n`` output columns of ``k`` inputs, in the
    weight format ``format`` (``cloud.engine.formats``: which gemm reads them)."""

    backend: str
    bits: int
    n: int
    k: int
    tensors: tuple[torch.Tensor, ...]
    format: str = ""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


def _blocks(t: torch.Tensor, n: int) -> torch.Tensor:
    """[N, ...] -> [N / 16, 16, ...], padding N up to whole blocks of 16 with zeros."""
    pad = -n % LANES
    if pad:
        t = torch.cat([t, t.new_zeros((pad, *t.shape[1:]))])
    return t.reshape(-1, LANES, *t.shape[1:])


def _vnni_scales(s: torch.Tensor, n: int) -> torch.Tensor:
    """[N, G] integer group scales -> [N / 16, G / 2, 16, 2] int16 (pairs of groups per lane)."""
    b = _blocks(s.to(torch.int16), n)  # [NB, 16, G]
    return b.reshape(b.shape[0], LANES, -1, 2).permute(0, 2, 1, 3).contiguous()


def _vnni_super(d: torch.Tensor, n: int) -> torch.Tensor:
    """[N, B] float super-block scales -> [N / 16, B, 16]."""
    return _blocks(d.float(), n).permute(0, 2, 1).contiguous()


def _pack_vnni(bits: int, tensors: tuple[torch.Tensor, ...], n: int, k: int) -> tuple:
    if bits == 8:
        q, sc, d = tensors
        u = (q.to(torch.int16) + 128).to(torch.uint8)  # the kernel's u8 x s8 products
        b = _blocks(u, n).reshape(-1, LANES, k // GROUP, 8, 4)  # [NB, 16, G, j, t]
        return b.permute(0, 2, 3, 1, 4).contiguous(), _vnni_scales(sc, n), _vnni_super(d, n)
    packed, sc, d, mn, dm = tensors
    levels = _blocks(int4_levels(packed), n).reshape(-1, LANES, k // GROUP, 4, 2, 4)
    byte = levels[..., 0, :] | (levels[..., 1, :] << 4)  # [NB, 16, G, i, t]: 8i + t, 8i + 4 + t
    return (
        byte.permute(0, 2, 3, 1, 4).contiguous(),
        _vnni_scales(sc, n),
        _vnni_super(d, n),
        _vnni_scales(mn, n),
        _vnni_super(dm, n),
    )


def pack(backend: str, bits: int, tensors: tuple[torch.Tensor, ...]) -> KernelWeights:
    """Natural-layout weights (``cloud.engine.quantized``) -> ``backend``'s layout."""
    n = tensors[0].shape[0]
    k = tensors[0].shape[1] * (2 if bits == 4 else 1)
    check_width(k)
    if backend == "avx2":
        packed = (paired(tensors[0]), *tensors[1:]) if bits == 8 else tuple(tensors)
    elif backend == "avx512vnni":
        packed = _pack_vnni(bits, tensors, n, k)
    else:
        raise ValueError(f"unknown kernel backend {backend!r}; one of {BACKENDS}")
    fmt = {8: "int8", 4: "int4"}[bits]
    return KernelWeights(backend, bits, n, k, tuple(t.contiguous() for t in packed), fmt)


def reference_gemm(
    xq: torch.Tensor,  # [M, K] int8, natural order
    xs: torch.Tensor,  # [M, B] float32
    xsum: torch.Tensor,  # [M, G] int16
    bits: int,
    tensors: tuple[torch.Tensor, ...],  # natural layout
) -> torch.Tensor:
    """[M, N]: the canonical product (cpu_kernels.c's header), computed in torch."""
    m, k = xq.shape
    groups = k // GROUP
    p = per_block(k)
    blocks = groups // p
    if bits == 8:
        q, sc, d = tensors
        mn = dm = None
    else:
        packed, sc, d, mn, dm = tensors
        q = int4_levels(packed)
    n = q.shape[0]
    # exact integers: float64 holds every partial sum here (< 2^31) without rounding
    dots = torch.einsum(
        "mgk,ngk->mng",
        xq.double().reshape(m, groups, GROUP),
        q.double().reshape(n, groups, GROUP),
    )
    s = (dots * sc.double()[None]).reshape(m, n, blocks, p).sum(-1).float()  # [M, N, B]
    if mn is None:
        o_sums = torch.zeros_like(s)
        dm = torch.zeros_like(d)
    else:
        o_sums = (mn.double()[None] * xsum.double()[:, None]).reshape(m, n, blocks, p).sum(-1)
        o_sums = o_sums.float()
    a = torch.zeros((m, n), dtype=torch.float32)
    o = torch.zeros((m, n), dtype=torch.float32)
    for b in range(blocks):
        dx = xs[:, b : b + 1].float()  # [M, 1]
        a = a + s[..., b] * (d[:, b].float()[None] * dx)
        o = o + o_sums[..., b] * (dm[:, b].float()[None] * dx)
    return a - o
