"""The CPU kernels' shared library: every ``cpu_*.c`` beside this file compiled into one
library, cached, and loaded by ctypes with the prototypes of ``cpu_kernels.h``; which matmul
kernel this process runs. ``cloud.engine.cpu_kernels`` makes the calls.

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

``backend()`` picks the best matmul kernel the CPU runs (AVX-512 VNNI, else AVX2;
``SPECSPLIT_CPU_KERNELS=avx2`` forces the older one): their results are bit for bit the same.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
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

from specsplit.cloud.engine.kernel_layouts import BACKENDS
from specsplit.shared.build_steps import cache_dir, locked

log = logging.getLogger(__name__)

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

# The header's prototypes (cpu_kernels.h), set on the loaded functions; a parameter struct
# (cloud.engine.cpu_kernels.STRUCTS) is passed by pointer (ctypes.byref), so a pointer here.
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
    "specsplit_residual_add": [_P, _P, _INT],
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
