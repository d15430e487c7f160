"""cloud/engine/cpu_kernels.py's build and load: the library is built ahead (``specsplit-cloud
kernels``) from every cpu_*.c, keyed by its sources, flags and compiler, loaded only from a
directory of this user's, never where the CPU cannot run it, and loudly unavailable otherwise;
its ctypes table agrees with cpu_kernels.h; QuantizedRows keeps what C reads alive."""

from __future__ import annotations

import ctypes
import logging
import os
import re
import shutil
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

from specsplit.cloud.engine import cpu_kernels as kernels

HEADER = kernels.HEADER
needs_kernels = pytest.mark.skipif(not kernels.available(), reason="needs the AVX2 CPU kernels")
BUILT = kernels.build()[0] if kernels.available() else None  # the real library, built ahead


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """The kernels' cached state cleared (and cleared again after), with the library's
    directory in tmp_path/kernels; ctypes.CDLL fails the test unless a test allows it."""

    cached = (kernels.library, kernels.unavailable, kernels.backend, kernels.compiler)

    def clear():
        for fn in cached:
            fn.cache_clear()

    clear()
    monkeypatch.setenv(kernels.DIR_ENV, str(tmp_path / "kernels"))

    def no_loading(path, *args, **kwargs):
        raise AssertionError(f"loaded {path}")

    monkeypatch.setattr(ctypes, "CDLL", no_loading)
    yield tmp_path / "kernels"
    clear()


# -- the CPU, checked before anything is built or loaded -------------------------------------


def test_not_x86_64_is_unavailable_with_a_warning_of_the_cost(fresh, monkeypatch, caplog):
    monkeypatch.setattr(kernels.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(kernels, "_compile", lambda *a: pytest.fail("compiled on arm64"))
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        assert not kernels.available()
    [record] = [r for r in caplog.records if r.name == kernels.__name__]
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert "x86-64, not aarch64" in message
    assert "10x slower" in message and "bit-exact under batching" in message
    assert not fresh.exists()  # nothing built, nothing loaded


def test_windows_names_x86_64_amd64(monkeypatch):
    monkeypatch.setattr(kernels.platform, "machine", lambda: "AMD64")
    monkeypatch.setattr(kernels, "cpu_features", lambda: None)  # no /proc/cpuinfo there
    kernels.check_cpu()


def test_a_cpu_without_avx2_is_refused_before_loading(fresh, monkeypatch, caplog):
    monkeypatch.setattr(kernels.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(kernels, "cpu_features", lambda: frozenset({"sse4_2", "fma", "avx"}))
    with pytest.raises(kernels.KernelsUnavailable, match=r"lacks \['avx2'\]"):
        kernels.library()
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        assert kernels.unavailable() and "10x slower" in caplog.text


def test_cpu_features_are_read_from_proc_cpuinfo(monkeypatch, tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu sse2 avx2 fma\n")
    real_open = open
    monkeypatch.setattr(
        "builtins.open", lambda p, *a, **k: real_open(info if p == "/proc/cpuinfo" else p, *a, **k)
    )
    assert kernels.cpu_features() == {"fpu", "sse2", "avx2", "fma"}
    assert kernels.cpu_model() == "Some CPU"


def test_no_compiler_is_unavailable(fresh, monkeypatch):
    monkeypatch.setattr(kernels, "check_cpu", lambda: None)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(kernels.shutil, "which", lambda name: None)
    with pytest.raises(kernels.KernelsUnavailable, match="no C compiler"):
        kernels.library()


# -- the build: what it compiles, its key, its timeout ---------------------------------------


def test_every_cpu_c_file_is_compiled():
    here = Path(kernels.__file__).parent
    assert tuple(sorted(here.glob("cpu_*.c"))) == kernels.SOURCES
    assert {p.name for p in kernels.SOURCES} >= {"cpu_kernels.c", "cpu_attention.c"}


def test_the_key_covers_the_compiler_version_and_the_flags(fresh, monkeypatch):
    monkeypatch.setattr(kernels, "compiler", lambda: kernels.Compiler(("cc",), "cc 12.2.0"))
    base = kernels.library_path()
    assert base.parent.parent == fresh
    monkeypatch.setattr(kernels, "compiler", lambda: kernels.Compiler(("cc",), "cc 13.1.0"))
    newer = kernels.library_path()
    monkeypatch.setattr(kernels, "FLAGS", [*kernels.FLAGS, "-march=native"])
    flagged = kernels.library_path()
    assert len({base, newer, flagged}) == 3


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_a_compiler_past_its_timeout_is_unavailable(fresh, monkeypatch):
    monkeypatch.setattr(kernels, "check_cpu", lambda: None)
    monkeypatch.setattr(kernels, "COMPILE_TIMEOUT_S", 0.001)
    with pytest.raises(kernels.KernelsUnavailable, match="took longer than 0.001 s"):
        kernels.build()
    assert not kernels.library_path().exists()


@needs_kernels
def test_loading_compiles_only_when_nothing_was_built(fresh, monkeypatch, caplog):
    """A server's load finds the library built ahead and compiles nothing; where nothing was
    built it builds, with a WARNING that says how to build ahead."""
    monkeypatch.setattr(kernels, "check_cpu", lambda: None)
    compiled = []

    def fake_compile(cc, dest):
        compiled.append(dest)
        shutil.copy(BUILT, dest)
        os.chmod(dest, 0o755)

    monkeypatch.setattr(kernels, "_compile", fake_compile)
    loaded = []
    monkeypatch.setattr(ctypes, "CDLL", lambda path: loaded.append(path) or _FakeLib())
    with caplog.at_level(logging.INFO, logger=kernels.__name__):
        kernels.library()
    assert len(compiled) == 1 and loaded == [str(compiled[0])]
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "at model load" in warning.getMessage()
    assert "`specsplit-cloud kernels`" in warning.getMessage()
    kernels.library.cache_clear()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=kernels.__name__):
        kernels.library()
    assert len(compiled) == 1 and len(loaded) == 2 and not caplog.records


class _FakeLib:
    """Stands for a loaded library: any function, returning 1."""

    def __getattr__(self, name):
        fn = lambda *args: 1  # noqa: E731
        return fn


# -- where the library may be loaded from -----------------------------------------------------


def _planted(fresh: Path, mode: int) -> Path:
    """A 'library' already in place at library_path(), with ``mode``."""
    path = kernels.library_path()
    fresh.mkdir(mode=0o700)
    path.parent.mkdir(mode=0o700)
    path.write_bytes(b"\x7fELF not really")
    os.chmod(path, mode)
    return path


def test_a_group_writable_directory_is_refused(fresh, monkeypatch):
    monkeypatch.setattr(kernels, "check_cpu", lambda: None)
    fresh.mkdir()
    os.chmod(fresh, 0o775)
    with pytest.raises(kernels.UnsafeLibraryPath) as e:
        kernels.library()
    assert str(fresh) in str(e.value) and f"chmod go-w {fresh}" in str(e.value)
    assert kernels.DIR_ENV in str(e.value)


def test_a_directory_of_another_user_is_refused(fresh, monkeypatch):
    monkeypatch.setattr(kernels, "check_cpu", lambda: None)
    fresh.mkdir(mode=0o700)
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(fresh).st_uid + 1)
    with pytest.raises(kernels.UnsafeLibraryPath, match="not by this user"):
        kernels.library()


def test_a_world_writable_library_file_is_refused(fresh, monkeypatch):
    monkeypatch.setattr(kernels, "check_cpu", lambda: None)
    path = _planted(fresh, 0o666)
    with pytest.raises(kernels.UnsafeLibraryPath) as e:
        kernels.library()
    assert str(path) in str(e.value)


def test_a_linked_library_file_is_refused(fresh, monkeypatch, tmp_path):
    monkeypatch.setattr(kernels, "check_cpu", lambda: None)
    path = _planted(fresh, 0o755)
    elsewhere = tmp_path / "elsewhere.so"
    path.rename(elsewhere)
    path.symlink_to(elsewhere)
    with pytest.raises(kernels.UnsafeLibraryPath, match="not a regular file|neither"):
        kernels.library()


def test_directories_it_creates_are_private_whatever_the_umask(fresh, monkeypatch):
    monkeypatch.setattr(kernels, "check_cpu", lambda: None)

    def fake_compile(cc, dest):
        dest.write_bytes(b"")
        os.chmod(dest, 0o755)

    monkeypatch.setattr(kernels, "_compile", fake_compile)
    old = os.umask(0o002)
    try:
        path, _ = kernels.build()
    finally:
        os.umask(old)
    for p in (fresh, path.parent):
        assert os.stat(p).st_mode & 0o077 == 0, oct(os.stat(p).st_mode)


# -- the ctypes table and the header ----------------------------------------------------------

_PROTOTYPE = re.compile(r"^(\w[\w \t*]*?)\b(specsplit_\w+)\s*\(([^)]*)\)\s*;", re.M)
_C_KINDS = {"int64_t": "int64", "float": "float", "int": "int", "void": None}


def _c_kind(decl: str) -> str | None:
    """A C parameter or return type -> pointer / int64 / float / int / None (void)."""
    if "*" in decl:
        return "pointer"
    words = [w for w in decl.split() if w != "const"]
    return _C_KINDS[words[0]]


def _ctypes_kind(t) -> str | None:
    if t is None:
        return None
    if t in (ctypes.c_void_p, ctypes.c_char_p) or issubclass(t, ctypes._Pointer | ctypes.Array):
        return "pointer"
    return {ctypes.c_int64: "int64", ctypes.c_float: "float", ctypes.c_int: "int"}[t]


def header_prototypes() -> dict[str, tuple[str | None, list[str]]]:
    """cpu_kernels.h's exported functions: name -> (return kind, parameter kinds)."""
    out = {}
    for ret, name, params in _PROTOTYPE.findall(HEADER.read_text()):
        params = " ".join(params.split())
        kinds = [] if params == "void" else [_c_kind(p) for p in params.split(",")]
        out[name] = (_c_kind(ret), kinds)
    return out


def test_the_header_parser_reads_prototypes():
    text = "int f(void);\nvoid specsplit_x(const float *a, int64_t n,\n  float s, int t);\n"
    [(ret, name, params)] = _PROTOTYPE.findall(text)
    assert (name, _c_kind(ret)) == ("specsplit_x", None)
    assert [_c_kind(p) for p in params.split(",")] == ["pointer", "int64", "float", "int"]


def test_the_ctypes_table_matches_the_header():
    """Every function in _SIGNATURES is declared in cpu_kernels.h and the other way round,
    with the same argument count and kinds (pointer / int64 / float / int) and return kind."""
    declared = header_prototypes()
    assert set(kernels._SIGNATURES) == set(declared), (
        f"only in _SIGNATURES: {sorted(set(kernels._SIGNATURES) - set(declared))}; "
        f"only in cpu_kernels.h: {sorted(set(declared) - set(kernels._SIGNATURES))}"
    )
    for name, args in kernels._SIGNATURES.items():
        ret, params = declared[name]
        assert [_ctypes_kind(a) for a in args] == params, name
        assert _ctypes_kind(kernels._RETURNS.get(name)) == ret, name


_STRUCT = re.compile(r"typedef struct \{(.*?)\}\s*(specsplit_\w+)\s*;", re.S)
_STRUCT_KINDS = {"int64_t": "int64", "int32_t": "int32", "float": "float"}


def header_structs() -> dict[str, list[tuple[str, str]]]:
    """cpu_kernels.h's parameter structs: name -> [(field, pointer / int64 / int32 / float)]."""
    out = {}
    for body, name in _STRUCT.findall(HEADER.read_text()):
        body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
        fields = []
        for decl in filter(None, (d.strip() for d in body.split(";"))):
            words = decl.replace("*", " * ").replace(",", " , ").split()
            base = [w for w in words if w not in ("const", "*", ",")][0]
            # each declarator: its name, and whether a * came before it (after the base type)
            star = False
            for w in words[words.index(base) + 1 :]:
                if w == "*":
                    star = True
                elif w == ",":
                    star = False
                elif w != "const":
                    fields.append((w, "pointer" if star else _STRUCT_KINDS.get(base, base)))
        out[name] = fields
    return out


def _field_kind(t) -> str:
    if t is ctypes.c_void_p:
        return "pointer"
    return {ctypes.c_int64: "int64", ctypes.c_int32: "int32", ctypes.c_float: "float"}[t]


def test_the_header_struct_parser_reads_fields():
    kinds = dict(header_structs()["specsplit_segments"])
    assert kinds == dict.fromkeys(("slot", "cap", "start", "len", "row0"), "pointer") | {
        "count": "int64"
    }


def test_the_ctypes_structs_match_the_header():
    """Every parameter struct of cpu_kernels.h has its ctypes twin, field for field in order
    (names and kinds), so C and Python read the same bytes."""
    declared = {n: f for n, f in header_structs().items() if not n.startswith("specsplit_block_q")}
    assert set(kernels.STRUCTS) == set(declared)
    for name, struct in kernels.STRUCTS.items():
        fields = [(f, _field_kind(t)) for f, t in struct._fields_]
        assert fields == declared[name], name


def test_the_gguf_block_structs_have_the_readers_sizes():
    """The header's typed GGUF blocks (with their _Static_asserts) and the Python readers that
    parse a file's blocks agree on every format's block size."""
    from specsplit.cloud.engine import block_quants, kquants

    sizes = dict(re.findall(r"sizeof\(specsplit_block_(\w+)\) == (\d+)", HEADER.read_text()))
    readers = kquants.GGUF_BLOCK_BYTES | block_quants.BLOCK_BYTES
    assert {f: int(b) for f, b in sizes.items()} == readers


@needs_kernels
@pytest.mark.skipif(shutil.which("nm") is None, reason="needs nm (binutils)")
def test_every_exported_function_is_declared_in_the_header():
    path, _ = kernels.build()
    out = subprocess.run(
        ["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True
    ).stdout
    exported = {line.split()[-1] for line in out.splitlines() if " T " in line}
    ours = {name for name in exported if name.startswith("specsplit_")}
    assert ours == set(header_prototypes())
    assert exported == ours, f"exported without the specsplit_ prefix: {exported - ours}"


# -- what C reads stays alive -----------------------------------------------------------------


def test_a_non_contiguous_norm_weight_outlives_the_kernel_call(monkeypatch):
    """QuantizedRows hands C the pointer of the norm weight's contiguous copy: that copy must
    still exist when C reads it (a temporary made in the call's arguments is freed before)."""
    made: list[tuple[int, weakref.ref]] = []
    real = torch.Tensor.contiguous

    def contiguous(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        made.append((out.data_ptr(), weakref.ref(out)))
        return out

    seen = {}

    class Lib:
        def specsplit_rmsnorm_quantize(self, x, w, *rest):
            seen["alive"] = any(ptr == w and ref() is not None for ptr, ref in made)

    monkeypatch.setattr(torch.Tensor, "contiguous", contiguous)
    monkeypatch.setattr(kernels, "library", Lib)
    weight = torch.rand(128)[::2]  # [64], strided
    kernels.QuantizedRows(torch.randn(2, 64), (weight, 1e-6), kernel="avx2")
    assert seen == {"alive": True}


@needs_kernels
def test_a_non_contiguous_norm_weight_gives_the_contiguous_ones_rows():
    gen = torch.Generator().manual_seed(3)
    x, weight = torch.randn(5, 256, generator=gen), torch.rand(512, generator=gen)[::2]
    a = kernels.QuantizedRows(x, (weight, 1e-6))
    b = kernels.QuantizedRows(x, (weight.contiguous(), 1e-6))
    assert torch.equal(a.xq, b.xq) and torch.equal(a.xs, b.xs) and torch.equal(a.xsum, b.xsum)


# -- specsplit-cloud kernels, a real process -----------------------------------------------


def _kernels_cli(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "specsplit.cloud.cli", "kernels", "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )


@needs_kernels
def test_the_kernels_command_reports_the_backend_and_bandwidth():
    done = _kernels_cli({})
    assert done.returncode == 0, done.stderr
    lines = dict(line.split(None, 1) for line in done.stdout.splitlines())
    assert lines["backend"].split()[0] == kernels.backend()
    assert str(BUILT) in lines["library"]
    assert "avx2" in lines["cpu"] and re.search(r"= [\d.]+ GB/s on 1 thread", lines["gemm"])


def test_the_kernels_command_fails_clearly_where_kernels_cannot_load(tmp_path):
    unsafe = tmp_path / "shared"
    unsafe.mkdir()
    os.chmod(unsafe, 0o777)
    done = _kernels_cli({kernels.DIR_ENV: str(unsafe)})
    assert done.returncode == 1
    try:
        kernels.check_cpu()
    except kernels.KernelsUnavailable as e:  # a CPU without kernels says so first
        assert str(e) in done.stderr
    else:
        assert f"refusing to load the CPU kernels from {unsafe}" in done.stderr
    assert "float weights" in done.stderr


def test_the_kernels_build_wherever_the_cpu_and_a_compiler_allow():
    """Kernel tests skip where the kernels cannot run: on a machine that can run them, a
    library that fails to build (a broken header, a bad merge) must fail here, not turn every
    bit-identity test into a skip."""
    try:
        kernels.check_cpu()
        kernels.compiler()
    except kernels.KernelsUnavailable as e:
        pytest.skip(f"this machine cannot run the kernels: {e}")
    assert kernels.unavailable() is None


_CLANG_FORMAT = Path(sys.executable).with_name("clang-format")  # the dev extra's pinned one


@pytest.mark.skipif(not _CLANG_FORMAT.exists(), reason="needs the dev extra's clang-format")
def test_the_c_sources_are_formatted():
    """Every cpu_*.c and the header as .clang-format lays them out (`clang-format -i`)."""
    sources = [str(p) for p in (*kernels.SOURCES, HEADER)]
    done = subprocess.run(
        [str(_CLANG_FORMAT), "--dry-run", "--Werror", *sources], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
