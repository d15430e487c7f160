"""The target's batch-invariant CPU kernels (``cpu_kernels.c``): compiled once, called by ctypes.

Why our own kernels: on CPUs without bf16 matrix instructions torch's weight-only int8/int4
kernels cost in proportion to the rows (a verify block of 9 rows costs 3-5x one row), and none
of torch's matmuls promise that a row's result is independent of the other rows in the call.
These read each weight once per pass for every row (memory-bound, like llama.cpp's), quantise
activations to int8 per 32 values, and compute every output element by one fixed sequence of
operations (see the C file's contract), so a row's logits never depend on the batch.

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

from specsplit.shared.steps import cache_dir, locked

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
GROUP = 32  # values per quantisation group, along the input dimension
PAIR = 2 * GROUP  # the kernels read groups in pairs: input dimensions are multiples of this
MAX_HEAD_DIM = 512
FLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared"]

_P, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "specsplit_has_avx2": [],
    "specsplit_quantize_rows": [_P, _I64, _I64, _P, _P, _P, _INT],
    "specsplit_rmsnorm_quantize": [_P, _P, _F32, _I64, _I64, _P, _P, _P, _INT],
    "specsplit_rope": [_P, _I64, _I64, _I64, _I64, _P, _P],
    "specsplit_gemm": [_P, _P, _P, _I64, _I64, _P, _P, _P, _P, _P, _I64, _P, _INT],
    "specsplit_attention": [_P, _P, _P, _I64, _I64, _I64, _I64, _P, _I64, _P, _P, _P, _P, _F32]
    + [_P, _INT],
}


class KernelsUnavailable(RuntimeError):
    """No compiler, no AVX2 + FMA, or not an x86-64 Linux machine."""


def _build(dest: Path) -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise KernelsUnavailable("no C compiler (cc/gcc) to build the CPU kernels")
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        out = Path(tmp) / dest.name
        cmd = [cc, *FLAGS, "-o", str(out), str(SOURCE), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise KernelsUnavailable(f"building the CPU kernels failed:\n{done.stderr[-2000:]}")
        os.replace(out, dest)


@cache
def library() -> ctypes.CDLL:
    """The loaded kernels, built on first use; raises KernelsUnavailable."""
    if os.uname().machine not in ("x86_64", "AMD64"):
        raise KernelsUnavailable(f"the CPU kernels need x86-64, not {os.uname().machine}")
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
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
    lib.specsplit_has_avx2.restype = ctypes.c_int
    if not lib.specsplit_has_avx2():
        raise KernelsUnavailable("the CPU kernels need AVX2 and FMA")
    return lib


def available() -> bool:
    try:
        library()
    except (KernelsUnavailable, OSError) as e:
        log.info("CPU kernels unavailable: %s", e)
        return False
    return True


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def check_width(k: int) -> None:
    """Raises ValueError unless the kernels can read rows of ``k`` values."""
    if k % PAIR:
        raise ValueError(f"input dimension {k} is not a multiple of {PAIR} (the CPU kernels')")


def fits(config) -> bool:
    """Whether every projection of a Llama-style decoder reads rows the kernels take."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    widths = (config.hidden_size, config.intermediate_size, heads * head_dim)
    return all(w % PAIR == 0 for w in widths)


def per_block(k: int) -> int:
    """Groups per super-block for rows of ``k`` values (as the C side computes it)."""
    groups = k // GROUP
    return next(p for p in (8, 4, 2) if groups % p == 0)


def paired(t: torch.Tensor) -> torch.Tensor:
    """[..., K] in natural order <-> the kernels' paired layout (cpu_kernels.c), either way:
    each pair of groups as [g 0..15 | g+1 0..15 | g 16..31 | g+1 16..31]."""
    *lead, k = t.shape
    check_width(k)
    halves = t.reshape(*lead, k // PAIR, 2, 2, GROUP // 2)  # [pairs, group, half, 16]
    return halves.transpose(-3, -2).reshape(*lead, k).contiguous()


class QuantizedRows:
    """Activations quantised to int8, one scale per super-block: ``x ~ xs * xq`` (xq in the
    paired layout, ``paired``); built once per input and shared by every matmul that reads it."""

    def __init__(self, x: torch.Tensor, norm: tuple[torch.Tensor, float] | None = None):
        """x [M, K] float32; ``norm`` = (weight [K] float32, eps): quantise RMSNorm(x) instead
        (Llama's and Qwen2's: ``w * x / sqrt(mean(x^2) + eps)``), fused in one pass."""
        x = x.contiguous()
        self.rows, self.k = x.shape
        check_width(self.k)
        groups = self.k // GROUP
        self.xq = torch.empty((self.rows, self.k), dtype=torch.int8)
        self.xs = torch.empty((self.rows, groups // per_block(self.k)), dtype=torch.float32)
        self.xsum = torch.empty((self.rows, groups), dtype=torch.int16)
        out = (_ptr(self.xq), _ptr(self.xs), _ptr(self.xsum), _threads())
        if norm is None:
            library().specsplit_quantize_rows(_ptr(x), self.rows, self.k, *out)
        else:
            weight, eps = norm
            if weight.dtype != torch.float32 or weight.shape != (self.k,):
                raise ValueError("the norm's weight must be float32 of the rows' width")
            library().specsplit_rmsnorm_quantize(
                _ptr(x), _ptr(weight.contiguous()), eps, self.rows, self.k, *out
            )


def gemm(
    x: QuantizedRows,
    q: torch.Tensor,  # [N, K] int8 (paired), or [N, K / 2] uint8 (int4, packed)
    sc: torch.Tensor,  # [N, G] uint8 (int8), int16 (int4)
    d: torch.Tensor,  # [N, B] float32
    mn: torch.Tensor | None = None,  # [N, G] int16 (int4 only)
    dm: torch.Tensor | None = None,  # [N, B] float32 (int4 only)
) -> torch.Tensor:
    """[M, N] = x @ w.T for int8 (mn, dm None) or int4 weights (formats: cpu_kernels.c)."""
    out = torch.empty((x.rows, q.shape[0]), dtype=torch.float32)
    library().specsplit_gemm(
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
        q.shape[0],
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
) -> torch.Tensor:
    """Writes each segment's new keys/values of ``layer`` into its slot, then returns the
    causal attention of every row over its own session's positions ``0..start + i``."""
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
        _ptr(out),
        _threads(),
    )
    return out


def rope(x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotates, in place, the first ``heads`` heads of each row of ``x`` [R, width] float32
    (Llama's "rotate half" rotary embedding); cos/sin [R, head_dim] float32."""
    rows, width = x.shape
    if not x.is_contiguous() or x.dtype != torch.float32 or heads * head_dim > width:
        raise ValueError("rope needs contiguous float32 rows holding the heads")
    if head_dim % 16 or cos.shape != (rows, head_dim) or sin.shape != (rows, head_dim):
        raise ValueError("rope needs head_dim % 16 == 0 and cos/sin of [rows, head_dim]")
    cos, sin = cos.float().contiguous(), sin.float().contiguous()  # held: C reads them
    library().specsplit_rope(_ptr(x), rows, width, heads, head_dim, _ptr(cos), _ptr(sin))


def _threads() -> int:
    return torch.get_num_threads()
