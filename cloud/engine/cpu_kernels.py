"""The target's batch-invariant CPU kernels (``cpu_kernels.c``, ``cpu_attention.c``): compiled once,
called by ctypes.

Why our own kernels: torch's weight-only int8/int4 kernels cost in proportion to the rows (a
verify block of 9 rows costs 3-5x one row), and none of torch's matmuls promise that a row's
result is independent of the other rows in the call. These read each weight once per pass for
every row (memory-bound, like llama.cpp's), quantise activations to int8 per 32 values, and
compute every output element by one fixed sequence of operations (the C file's contract;
``kernel_layouts.reference_gemm``), so a row's logits never depend on the batch.

Two matmul kernels compute that same product: AVX2 (``vpmaddubsw``, any x86-64 of the last
decade) and AVX-512 VNNI (``vpdpbusd``, 16 output columns a vector: about 4x fewer instructions
per extra row, so a verify block costs much less than its rows' one-row steps). ``backend()``
picks the best the CPU has (``SPECSPLIT_CPU_KERNELS=avx2`` forces the older one); their results
are bit for bit the same, so a target on one CPU answers as it does on another.

The shared library is built with the system C compiler into the cache
(``cache_dir()/kernels/<source hash>/``) on first use, under a lock; without a compiler or an
AVX2 + FMA CPU, ``available()`` is False and the target keeps torch's float path. ctypes
releases the GIL for the duration of each call.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

from specsplit.cloud.engine import decoder, kernel_layouts
from specsplit.cloud.engine.kernel_layouts import (
    BACKENDS,
    GROUP,
    PAIR,
    KernelWeights,
    check_width,
    paired,
    per_block,
)
from specsplit.shared.steps import cache_dir, locked

log = logging.getLogger(__name__)

__all__ = ["GROUP", "PAIR", "KernelWeights", "check_width", "paired", "per_block"]  # re-exported

# Compiled together into one library; the header is part of what the cache key hashes.
SOURCES = tuple(
    Path(__file__).with_name(n) for n in ("cpu_kernels.c", "cpu_attention.c", "cpu_block_quants.c")
)
HEADER = Path(__file__).with_name("cpu_kernels.h")
BACKEND_ENV = "SPECSPLIT_CPU_KERNELS"
FLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared"]

_P, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "specsplit_has_avx2": [],
    "specsplit_has_avx512vnni": [],
    "specsplit_quantize_rows": [_P, _I64, _I64, _P, _P, _P, _INT, _INT],
    "specsplit_rmsnorm_quantize": [_P, _P, _F32, _I64, _I64, _P, _P, _P, _INT, _INT],
    "specsplit_rope": [_P, _I64, _I64, _I64, _I64, _I64, _P, _P],
    "specsplit_gemm": [_P, _P, _P, _I64, _I64, _P, _P, _P, _P, _P, _I64, _P, _INT],
    "specsplit_gemm_vnni": [_P, _P, _P, _I64, _I64, _P, _P, _P, _P, _P, _I64, _P, _INT],
    "specsplit_attention": [_P, _P, _P, _I64, _I64, _I64, _I64, _P, _I64, _P, _P, _P, _P, _F32]
    + [_I64, _F32, _P, _INT],
    "specsplit_block_gemm": [_INT, _P, _P, _P, _I64, _I64, _P, _P, _P, _I64, _P, _INT],
    "specsplit_block_gemm_vnni": [_INT, _P, _P, _P, _I64, _I64, _P, _P, _P, _I64, _P, _INT],
}


class KernelsUnavailable(RuntimeError):
    """No compiler, no AVX2 + FMA, or not an x86-64 Linux machine."""


def _build(dest: Path) -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise KernelsUnavailable("no C compiler (cc/gcc) to build the CPU kernels")
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        out = Path(tmp) / dest.name
        cmd = [cc, *FLAGS, "-o", str(out), *map(str, SOURCES), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise KernelsUnavailable(f"building the CPU kernels failed:\n{done.stderr[-2000:]}")
        os.replace(out, dest)


@cache
def library() -> ctypes.CDLL:
    """The loaded kernels, built on first use; raises KernelsUnavailable."""
    if os.uname().machine not in ("x86_64", "AMD64"):
        raise KernelsUnavailable(f"the CPU kernels need x86-64, not {os.uname().machine}")
    code = b"".join(path.read_bytes() for path in (*SOURCES, HEADER))
    digest = hashlib.sha256(code + " ".join(FLAGS).encode()).hexdigest()[:16]
    dest = cache_dir() / "kernels" / digest / "libspecsplit_kernels.so"
    if not dest.is_file():
        dest.parent.mkdir(parents=True, exist_ok=True)
        with locked(f"kernels-{digest}"):
            if not dest.is_file():
                log.info("building the CPU kernels into %s", dest)
                _build(dest)
    lib = ctypes.CDLL(str(dest))
    for name, args in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, None
    lib.specsplit_has_avx2.restype = lib.specsplit_has_avx512vnni.restype = ctypes.c_int
    if not lib.specsplit_has_avx2():
        raise KernelsUnavailable("the CPU kernels need AVX2 and FMA")
    return lib


def supported_backends() -> list[str]:
    """The matmul kernels this CPU runs, best last."""
    lib = library()
    return ["avx2", *(["avx512vnni"] if lib.specsplit_has_avx512vnni() else [])]


@cache
def backend() -> str:
    """The matmul kernel this process uses: ``$SPECSPLIT_CPU_KERNELS`` if set, else the best
    the CPU has. Fixed for the process's life: weights are packed once, in its layout."""
    names = supported_backends()
    wanted = os.environ.get(BACKEND_ENV, "")
    if wanted:
        if wanted not in BACKENDS:
            raise ValueError(f"{BACKEND_ENV}={wanted!r}: not one of {BACKENDS}")
        if wanted not in names:
            raise KernelsUnavailable(f"{BACKEND_ENV}={wanted}: this CPU runs only {names}")
        return wanted
    return names[-1]


def available() -> bool:
    try:
        library()
    except (KernelsUnavailable, OSError) as e:
        log.info("CPU kernels unavailable: %s", e)
        return False
    return True


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def fits(config) -> bool:
    """Whether every projection of the decoder reads rows the kernels take, and its heads are
    a whole number of 16-value steps (the attention and rotary kernels'): so that a calibration
    never picks a format whose engine would refuse the model."""
    head_dim = decoder.head_dim(config)
    widths = (config.hidden_size, config.intermediate_size, config.num_attention_heads * head_dim)
    return head_dim % 16 == 0 and all(w % PAIR == 0 for w in widths)


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
        self.backend = kernel or backend()
        groups = self.k // GROUP
        self.xq = torch.empty((self.rows, self.k), dtype=torch.int8)
        self.xs = torch.empty((self.rows, groups // per_block(self.k)), dtype=torch.float32)
        self.xsum = torch.empty((self.rows, groups), dtype=torch.int16)
        layout = 1 if self.backend == "avx2" else 0
        out = (_ptr(self.xq), _ptr(self.xs), _ptr(self.xsum), layout, _threads())
        if norm is None:
            library().specsplit_quantize_rows(_ptr(x), self.rows, self.k, *out)
        else:
            weight, eps = norm
            if weight.dtype != torch.float32 or weight.shape != (self.k,):
                raise ValueError("the norm's weight must be float32 of the rows' width")
            library().specsplit_rmsnorm_quantize(
                _ptr(x), _ptr(weight.contiguous()), eps, self.rows, self.k, *out
            )


def pack(bits: int, tensors: tuple[torch.Tensor, ...], kernel: str | None = None) -> KernelWeights:
    """Natural-layout weights (``cloud.engine.quantized``) in the layout of ``kernel``
    [``backend()``]."""
    return kernel_layouts.pack(kernel or backend(), bits, tensors)


def gemm(x: QuantizedRows, w: KernelWeights) -> torch.Tensor:
    """[M, N] = x @ w.T, w in the layout of x's kernel (``kernel_layouts.pack``)."""
    if w.backend != x.backend or w.k != x.k:
        raise ValueError(f"weights for {w.backend} x {w.k} given rows for {x.backend} x {x.k}")
    out = torch.empty((x.rows, w.n), dtype=torch.float32)
    q, sc, d, *offsets = w.tensors
    mn, dm = offsets if offsets else (None, None)
    fn = library().specsplit_gemm if w.backend == "avx2" else library().specsplit_gemm_vnni
    fn(
        _ptr(x.xq),
        _ptr(x.xs),
        _ptr(x.xsum),
        x.rows,
        x.k,
        _ptr(q),
        _ptr(sc),
        _ptr(d),
        None if mn is None else _ptr(mn),
        None if dm is None else _ptr(dm),
        w.n,
        _ptr(out),
        _threads(),
    )
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
    library().specsplit_attention(
        _ptr(q),
        _ptr(k),
        _ptr(v),
        heads,
        k.shape[1],
        dim,
        batch.count,
        batch.bases,
        layer,
        batch.capacities,
        batch.starts,
        batch.lengths,
        batch.row0,
        scale,
        window or 0,
        softcap or 0.0,
        _ptr(out),
        _threads(),
    )
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
    library().specsplit_rope(_ptr(x), rows, width, heads, head_dim, rot, _ptr(cos), _ptr(sin))


def _threads() -> int:
    return torch.get_num_threads()
