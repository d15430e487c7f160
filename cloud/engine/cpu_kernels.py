"""The target's batch-invariant CPU kernels (``cpu_*.c`` beside this file): compiled once,
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

Building and loading (``specsplit-cloud kernels`` does both ahead of time; ``make setup`` and
deploy/Dockerfile run it, so a Triton model load finds the library built):
- every ``cpu_*.c`` beside this file (sorted) is compiled into one shared library, under
  ``kernels_dir()/<key>/``; the key hashes the sources, the header, ``FLAGS`` and the
  compiler's ``--version`` output, so a new compiler or flag builds anew. The compiler gets
  ``COMPILE_TIMEOUT_S``.
- the CPU is checked in Python before anything is built or loaded (``platform.machine()``;
  AVX2 and FMA in /proc/cpuinfo's flags on Linux; the library checks again itself).
- the library is loaded only from directories owned by this user and writable by no one else
  (``check_private``): its path is predictable, and anyone who can write there could plant a
  library the server would run.
Without a compiler or an AVX2 + FMA x86-64 CPU, ``available()`` is False, with one WARNING, and
the target keeps torch's float path. ctypes releases the GIL for the duration of each call.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import itertools
import logging
import os
import platform
import shlex
import shutil
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass
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
from specsplit.shared.build_steps import cache_dir, locked

log = logging.getLogger(__name__)

__all__ = ["GROUP", "PAIR", "KernelWeights", "check_width", "paired", "per_block"]  # re-exported

# Compiled together into one library: every cpu_*.c here, so a new kernel file needs no entry;
# the header is part of what the cache key hashes.
SOURCES = tuple(sorted(Path(__file__).parent.glob("cpu_*.c")))
HEADER = Path(__file__).with_name("cpu_kernels.h")
LIBRARY = "libspecsplit_kernels.so"
BACKEND_ENV = "SPECSPLIT_CPU_KERNELS"
DIR_ENV = "SPECSPLIT_KERNELS_DIR"  # where the built library lives; default cache_dir()/kernels
FLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared"]
COMPILE_TIMEOUT_S = 300  # seconds for the whole build (~2 s of CPU time with gcc 12)
X86_64 = ("x86_64", "amd64")  # platform.machine(): Linux/macOS, Windows
NEEDED = ("avx2", "fma")  # /proc/cpuinfo flags every kernel needs
SLOW_FALLBACK = (
    "the target falls back to float weights in torch: about 10x slower a token on CPU, and "
    "no longer bit-exact under batching (a row's logits then depend on the rows beside it, "
    "so a verify block and one-row steps can disagree)"
)

_P, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


# The header's parameter structs (cpu_kernels.h), field for field; a struct is passed by
# pointer (ctypes.byref), so the table below reads it as a pointer.
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


STRUCTS = {
    "specsplit_rows": Rows,
    "specsplit_weights": Weights,
    "specsplit_kq_weights": KQuantWeights,
    "specsplit_block_weights": BlockWeights,
    "specsplit_segments": Segments,
    "specsplit_attention_args": AttentionArgs,
    "specsplit_heads": Heads,
}

_SIGNATURES = {
    "specsplit_has_avx2": [],
    "specsplit_has_avx512vnni": [],
    "specsplit_quantize_rows": [_P, _P, _INT, _INT],
    "specsplit_rmsnorm_quantize": [_P, _P, _F32, _P, _INT, _INT],
    "specsplit_rope": [_P, _P, _P],
    "specsplit_gemm": [_P, _P, _P, _INT],
    "specsplit_gemm_vnni": [_P, _P, _P, _INT],
    "specsplit_attention": [_P, _P, _P, _INT],
    "specsplit_kq_gemm": [_P, _P, _P, _INT],
    "specsplit_kq_gemm_vnni": [_P, _P, _P, _INT],
    "specsplit_block_gemm": [_P, _P, _P, _INT],
    "specsplit_block_gemm_vnni": [_P, _P, _P, _INT],
    "specsplit_act_mul": [_P, _I64, _I64, _INT, _P, _INT],
    "specsplit_act_mul_quantize": [_P, _INT, _P, _INT, _INT],
    "specsplit_rmsnorm": [_P, _P, _F32, _P, _I64, _INT],
    "specsplit_residual_add": [_P, _P, _I64, _I64, _P, _F32, _P, _INT],
    "specsplit_soft_cap": [_P, _I64, _F32, _P, _INT],
}
# Return types of the functions that return something (the others return void).
_RETURNS = {
    "specsplit_has_avx2": _INT,
    "specsplit_has_avx512vnni": _INT,
    "specsplit_attention": _INT,
    "specsplit_kq_gemm": _INT,  # -1: a q6_k call past its stack sums without a work buffer
    "specsplit_kq_gemm_vnni": _INT,
}


class KernelsUnavailable(RuntimeError):
    """No compiler, no AVX2 + FMA, not x86-64, or no safe place for the library."""


class UnsafeLibraryPath(KernelsUnavailable):
    """The library's directory (or file) could be written by someone other than this user."""


@dataclass(frozen=True)
class Compiler:
    command: tuple[str, ...]  # e.g. ("cc",), or $CC split as a shell would
    version: str  # its --version output: part of the cache key


def cpu_features() -> frozenset[str] | None:
    """The CPU's feature flags as Linux names them (/proc/cpuinfo), or None where unknown."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        return None
    return None


def cpu_model() -> str:
    """The CPU's name (/proc/cpuinfo's model name), else platform.processor()'s."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def check_cpu() -> None:
    """Raises KernelsUnavailable unless this is an x86-64 CPU with AVX2 and FMA (where the
    flags are unknown, the library's own check decides after loading)."""
    machine = platform.machine()
    if machine.lower() not in X86_64:
        raise KernelsUnavailable(f"the CPU kernels need x86-64, not {machine or 'unknown'}")
    flags = cpu_features()
    missing = [f for f in NEEDED if flags is not None and f not in flags]
    if missing:
        raise KernelsUnavailable(f"the CPU kernels need AVX2 and FMA; this CPU lacks {missing}")


@cache
def compiler() -> Compiler:
    """$CC, else cc, else gcc, with its version; raises KernelsUnavailable."""
    command = tuple(shlex.split(os.environ.get("CC", "")))
    if not command:
        found = shutil.which("cc") or shutil.which("gcc")
        if not found:
            raise KernelsUnavailable("no C compiler (cc/gcc) to build the CPU kernels")
        command = (found,)
    try:
        done = subprocess.run(
            [*command, "--version"], capture_output=True, text=True, timeout=30, check=True
        )
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelsUnavailable(f"the C compiler {' '.join(command)} does not run: {e}") from e
    return Compiler(command, done.stdout.strip())


def kernels_dir() -> Path:
    """``$SPECSPLIT_KERNELS_DIR``, default ``cache_dir()/kernels``."""
    return Path(os.environ.get(DIR_ENV) or cache_dir() / "kernels")


def library_path() -> Path:
    """Where this source, header, flags and compiler's library is (or would be) built."""
    if not SOURCES or not HEADER.is_file():
        raise KernelsUnavailable(f"no kernel sources (cpu_*.c, {HEADER.name}) in {HEADER.parent}")
    key = hashlib.sha256()
    for path in (*SOURCES, HEADER):
        key.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    key.update(" ".join(FLAGS).encode() + b"\0" + compiler().version.encode())
    return kernels_dir() / key.hexdigest()[:16] / LIBRARY


def check_private(path: Path) -> None:
    """Raises UnsafeLibraryPath unless ``path`` is owned by this user and neither group- nor
    world-writable (a file: also a regular file, not a link)."""
    if not hasattr(os, "geteuid"):
        raise UnsafeLibraryPath("the CPU kernels' library can only be checked on POSIX systems")
    st = path.stat() if path.is_dir() else path.lstat()
    problem = None
    if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
        problem = "neither a directory nor a regular file"
    elif st.st_uid != os.geteuid():
        problem = f"owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        problem = "writable by its group or by everyone" + f" (mode {stat.filemode(st.st_mode)})"
    if problem:
        raise UnsafeLibraryPath(
            f"refusing to load the CPU kernels from {path}: it is {problem}, so someone else "
            f"could plant a library there that this process would run. Fix: `chmod go-w {path}` "
            f"as its owner (and remove it if you do not own it), or set {DIR_ENV} to a "
            "directory of your own"
        )


def _private_dir(path: Path) -> None:
    """Creates ``path`` (mode 0700) if missing; then checks it is private (check_private)."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    check_private(path)


def _compile(cc: Compiler, dest: Path) -> None:
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        out = Path(tmp) / dest.name
        cmd = [*cc.command, *FLAGS, "-o", str(out), *map(str, SOURCES), "-lm"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            took = f"building the CPU kernels took longer than {COMPILE_TIMEOUT_S} s"
            raise KernelsUnavailable(f"{took}: {shlex.join(cmd)}") from None
        except OSError as e:
            raise KernelsUnavailable(f"could not run the C compiler: {e}") from e
        if done.returncode != 0:
            raise KernelsUnavailable(f"building the CPU kernels failed:\n{done.stderr[-2000:]}")
        os.chmod(out, 0o755)  # whatever the umask: writable by this user alone
        os.replace(out, dest)


def build(ahead: bool = True) -> tuple[Path, float | None]:
    """(the library's path, seconds its build took now, or None if it was built already).
    ``ahead``: called to build before serving (``specsplit-cloud kernels``); otherwise a build
    here is one at model load, which warns. Raises KernelsUnavailable."""
    check_cpu()
    dest = library_path()
    root = dest.parent.parent
    root.parent.mkdir(parents=True, exist_ok=True)  # the cache itself: ours to use, not judge
    _private_dir(root)
    _private_dir(dest.parent)
    seconds = None
    if not dest.exists():
        with locked(f"kernels-{dest.parent.name}"):
            if not dest.exists():
                log.log(
                    logging.INFO if ahead else logging.WARNING,
                    "building the CPU kernels into %s%s",
                    dest,
                    ""
                    if ahead
                    else " at model load: run `specsplit-cloud kernels` ahead (make setup and "
                    "deploy/Dockerfile do) so that no server compiles",
                )
                t0 = time.perf_counter()
                _compile(compiler(), dest)
                seconds = time.perf_counter() - t0
    check_private(dest)
    return dest, seconds


@cache
def library() -> ctypes.CDLL:
    """The loaded kernels, built first if nothing was built; raises KernelsUnavailable."""
    path, _ = build(ahead=False)
    lib = ctypes.CDLL(str(path))
    for name, args in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, _RETURNS.get(name)
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


@cache
def unavailable() -> str | None:
    """Why the kernels cannot run in this process, or None when they can. The first call
    that finds them unavailable logs a WARNING with the cost (SLOW_FALLBACK)."""
    try:
        library()
    except (KernelsUnavailable, OSError) as e:
        log.warning("CPU kernels unavailable: %s; %s", e, SLOW_FALLBACK)
        return str(e)
    return None


def available() -> bool:
    return unavailable() is None


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
        self.backend = kernel or backend()
        groups = self.k // GROUP
        self.xq = torch.empty((self.rows, self.k), dtype=torch.int8)
        self.xs = torch.empty((self.rows, groups // per_block(self.k)), dtype=torch.float32)
        self.xsum = torch.empty((self.rows, groups), dtype=torch.int16)
        out = (ctypes.byref(self.c_rows()), self.paired, _threads())
        if norm is None:
            library().specsplit_quantize_rows(_ptr(x), *out)
        else:
            weight, eps = norm
            if weight.dtype != torch.float32 or weight.shape != (self.k,):
                raise ValueError("the norm's weight must be float32 of the rows' width")
            weight = weight.contiguous()  # held: C reads it (a temporary's pointer would dangle)
            library().specsplit_rmsnorm_quantize(_ptr(x), _ptr(weight), eps, *out)

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
    [``backend()``]."""
    return kernel_layouts.pack(kernel or backend(), bits, tensors)


def gemm(x: QuantizedRows, w: KernelWeights) -> torch.Tensor:
    """[M, N] = x @ w.T, w in the layout of x's kernel (``kernel_layouts.pack``)."""
    if w.backend != x.backend or w.k != x.k:
        raise ValueError(f"weights for {w.backend} x {w.k} given rows for {x.backend} x {x.k}")
    out = torch.empty((x.rows, w.n), dtype=torch.float32)
    q, sc, d, *offsets = w.tensors
    mn, dm = (_ptr(t) for t in offsets) if offsets else (None, None)
    weights = Weights(w.n, _ptr(q), _ptr(sc), _ptr(d), mn, dm)
    fn = library().specsplit_gemm if w.backend == "avx2" else library().specsplit_gemm_vnni
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
    failed = library().specsplit_attention(
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
    library().specsplit_rope(ctypes.byref(vectors), _ptr(cos), _ptr(sin))


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
    library().specsplit_act_mul(_ptr(gu), gu.shape[0], f, kind, _ptr(out), _threads())
    return out


class ActivatedRows(QuantizedRows):
    """``QuantizedRows`` of act(gate) * up, gate_up [M, 2F] = (gate | up) float32, computed and
    quantised in one C call (``cpu_rowwise.c``): bit for bit ``QuantizedRows(act_mul(...))``,
    without the float product ever reaching torch."""

    def __init__(self, gate_up: torch.Tensor, act: str, kernel: str | None = None):
        gu, f, kind = _gate_up(gate_up, act)
        self.rows, self.k = gu.shape[0], f
        self.backend = kernel or backend()
        groups = f // GROUP
        self.xq = torch.empty((self.rows, f), dtype=torch.int8)
        self.xs = torch.empty((self.rows, groups // per_block(f)), dtype=torch.float32)
        self.xsum = torch.empty((self.rows, groups), dtype=torch.int16)
        library().specsplit_act_mul_quantize(
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
    library().specsplit_rmsnorm(
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
    library().specsplit_residual_add(
        _ptr(x),
        _ptr(branch),
        x.shape[0],
        x.shape[1],
        None if weight is None else _ptr(weight),
        eps,
        _ptr(out),
        _threads(),
    )
    return out


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap) elementwise (``decoder.soft_cap``'s), new float32; x as is if no cap."""
    if cap is None:
        return x
    if x.dtype != torch.float32 or not cap > 0:
        raise ValueError(f"soft_cap needs float32 values and a cap > 0, got {x.dtype}, {cap}")
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32)
    library().specsplit_soft_cap(_ptr(x), x.numel(), float(cap), _ptr(out), _threads())
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
