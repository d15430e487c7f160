"""cloud/engine/cpu_kernels.py against cpu_kernels.h: the ctypes prototypes
(``kernel_library._SIGNATURES``) and parameter structs (``STRUCTS``) agree with the header, every
exported function is declared there, the C sources are formatted; QuantizedRows keeps what C
reads alive."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

from specsplit.cloud.engine import cpu_kernels, kernel_library
from tests.cloud.engine.conftest import needs_kernels

HEADER = kernel_library.HEADER


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
    assert set(kernel_library._SIGNATURES) == set(declared), (
        f"only in _SIGNATURES: {sorted(set(kernel_library._SIGNATURES) - set(declared))}; "
        f"only in cpu_kernels.h: {sorted(set(declared) - set(kernel_library._SIGNATURES))}"
    )
    for name, args in kernel_library._SIGNATURES.items():
        ret, params = declared[name]
        assert [_ctypes_kind(a) for a in args] == params, name
        assert _ctypes_kind(kernel_library._RETURNS.get(name)) == ret, name


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
    assert set(cpu_kernels.STRUCTS) == set(declared)
    for name, struct in cpu_kernels.STRUCTS.items():
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
    path, _ = kernel_library.build()
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
    monkeypatch.setattr(kernel_library, "library", Lib)
    weight = torch.rand(128)[::2]  # [64], strided
    cpu_kernels.QuantizedRows(torch.randn(2, 64), (weight, 1e-6), kernel="avx2")
    assert seen == {"alive": True}


@needs_kernels
def test_a_non_contiguous_norm_weight_gives_the_contiguous_ones_rows():
    gen = torch.Generator().manual_seed(3)
    x, weight = torch.randn(5, 256, generator=gen), torch.rand(512, generator=gen)[::2]
    a = cpu_kernels.QuantizedRows(x, (weight, 1e-6))
    b = cpu_kernels.QuantizedRows(x, (weight.contiguous(), 1e-6))
    assert torch.equal(a.xq, b.xq) and torch.equal(a.xs, b.xs) and torch.equal(a.xsum, b.xsum)


_CLANG_FORMAT = Path(sys.executable).with_name("clang-format")  # the dev extra's pinned one


@pytest.mark.skipif(not _CLANG_FORMAT.exists(), reason="needs the dev extra's clang-format")
def test_the_c_sources_are_formatted():
    """Every cpu_*.c and the header as .clang-format lays them out (`clang-format -i`)."""
    sources = [str(p) for p in (*kernel_library.SOURCES, HEADER)]
    done = subprocess.run(
        [str(_CLANG_FORMAT), "--dry-run", "--Werror", *sources], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
