"""cloud/engine/kernel_library.py: the library is built ahead (``specsplit-cloud kernels``) from
every cpu_*.c, keyed by its sources, flags and compiler, loaded only from a directory of this
user's, never where the CPU cannot run it, and loudly unavailable otherwise."""

from __future__ import annotations

import ctypes
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specsplit.cloud.engine import kernel_library
from tests.cloud.engine.conftest import needs_kernels

# the real library, built ahead
BUILT = kernel_library.build()[0] if kernel_library.available() else None


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """The kernels' cached state cleared (and cleared again after), with the library's
    directory in tmp_path/kernels; ctypes.CDLL fails the test unless a test allows it."""

    cached = (
        kernel_library.library,
        kernel_library.unavailable,
        kernel_library.backend,
        kernel_library.compiler,
    )

    def clear():
        for fn in cached:
            fn.cache_clear()

    clear()
    monkeypatch.setenv(kernel_library.DIR_ENV, str(tmp_path / "kernels"))

    def no_loading(path, *args, **kwargs):
        raise AssertionError(f"loaded {path}")

    monkeypatch.setattr(ctypes, "CDLL", no_loading)
    yield tmp_path / "kernels"
    clear()


# -- the CPU, checked before anything is built or loaded -------------------------------------


def test_not_x86_64_is_unavailable_with_a_warning_of_the_cost(fresh, monkeypatch, caplog):
    monkeypatch.setattr(kernel_library.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(kernel_library, "_compile", lambda *a: pytest.fail("compiled on arm64"))
    with caplog.at_level(logging.WARNING, logger=kernel_library.__name__):
        assert not kernel_library.available()
    [record] = [r for r in caplog.records if r.name == kernel_library.__name__]
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert "x86-64, not aarch64" in message
    assert "10x slower" in message and "bit-exact under batching" in message
    assert not fresh.exists()  # nothing built, nothing loaded


def test_windows_names_x86_64_amd64(monkeypatch):
    monkeypatch.setattr(kernel_library.platform, "machine", lambda: "AMD64")
    monkeypatch.setattr(kernel_library, "cpu_features", lambda: None)  # no /proc/cpuinfo there
    kernel_library.check_cpu()


def test_a_cpu_without_avx2_is_refused_before_loading(fresh, monkeypatch, caplog):
    monkeypatch.setattr(kernel_library.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(kernel_library, "cpu_features", lambda: frozenset({"sse4_2", "fma", "avx"}))
    with pytest.raises(kernel_library.KernelsUnavailable, match=r"lacks \['avx2'\]"):
        kernel_library.library()
    with caplog.at_level(logging.WARNING, logger=kernel_library.__name__):
        assert kernel_library.unavailable() and "10x slower" in caplog.text


def test_cpu_features_are_read_from_proc_cpuinfo(monkeypatch, tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu sse2 avx2 fma\n")
    real_open = open
    monkeypatch.setattr(
        "builtins.open", lambda p, *a, **k: real_open(info if p == "/proc/cpuinfo" else p, *a, **k)
    )
    assert kernel_library.cpu_features() == {"fpu", "sse2", "avx2", "fma"}
    assert kernel_library.cpu_model() == "Some CPU"


def test_no_compiler_is_unavailable(fresh, monkeypatch):
    monkeypatch.setattr(kernel_library, "check_cpu", lambda: None)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(kernel_library.shutil, "which", lambda name: None)
    with pytest.raises(kernel_library.KernelsUnavailable, match="no C compiler"):
        kernel_library.library()


# -- the build: what it compiles, its key, its timeout ---------------------------------------


def test_every_cpu_c_file_is_compiled():
    here = Path(kernel_library.__file__).parent
    assert tuple(sorted(here.glob("cpu_*.c"))) == kernel_library.SOURCES
    assert {p.name for p in kernel_library.SOURCES} >= {"cpu_kernels.c", "cpu_attention.c"}


def test_the_key_covers_the_compiler_version_and_the_flags(fresh, monkeypatch):
    monkeypatch.setattr(
        kernel_library, "compiler", lambda: kernel_library.Compiler(("cc",), "cc 12.2.0")
    )
    base = kernel_library.library_path()
    assert base.parent.parent == fresh
    monkeypatch.setattr(
        kernel_library, "compiler", lambda: kernel_library.Compiler(("cc",), "cc 13.1.0")
    )
    newer = kernel_library.library_path()
    monkeypatch.setattr(kernel_library, "FLAGS", [*kernel_library.FLAGS, "-march=native"])
    flagged = kernel_library.library_path()
    assert len({base, newer, flagged}) == 3


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_a_compiler_past_its_timeout_is_unavailable(fresh, monkeypatch):
    monkeypatch.setattr(kernel_library, "check_cpu", lambda: None)
    monkeypatch.setattr(kernel_library, "COMPILE_TIMEOUT_S", 0.001)
    with pytest.raises(kernel_library.KernelsUnavailable, match="took longer than 0.001 s"):
        kernel_library.build()
    assert not kernel_library.library_path().exists()


@needs_kernels
def test_loading_compiles_only_when_nothing_was_built(fresh, monkeypatch, caplog):
    """A server's load finds the library built ahead and compiles nothing; where nothing was
    built it builds, with a WARNING that says how to build ahead."""
    monkeypatch.setattr(kernel_library, "check_cpu", lambda: None)
    compiled = []

    def fake_compile(cc, dest):
        compiled.append(dest)
        shutil.copy(BUILT, dest)
        os.chmod(dest, 0o755)

    monkeypatch.setattr(kernel_library, "_compile", fake_compile)
    loaded = []
    monkeypatch.setattr(ctypes, "CDLL", lambda path: loaded.append(path) or _FakeLib())
    with caplog.at_level(logging.INFO, logger=kernel_library.__name__):
        kernel_library.library()
    assert len(compiled) == 1 and loaded == [str(compiled[0])]
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "at model load" in warning.getMessage()
    assert "`specsplit-cloud kernels`" in warning.getMessage()
    kernel_library.library.cache_clear()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=kernel_library.__name__):
        kernel_library.library()
    assert len(compiled) == 1 and len(loaded) == 2 and not caplog.records


class _FakeLib:
    """Stands for a loaded library: any function, returning 1."""

    def __getattr__(self, name):
        fn = lambda *args: 1  # noqa: E731
        return fn


# -- where the library may be loaded from -----------------------------------------------------


def _planted(fresh: Path, mode: int) -> Path:
    """A 'library' already in place at library_path(), with ``mode``."""
    path = kernel_library.library_path()
    fresh.mkdir(mode=0o700)
    path.parent.mkdir(mode=0o700)
    path.write_bytes(b"\x7fELF not really")
    os.chmod(path, mode)
    return path


def test_a_group_writable_directory_is_refused(fresh, monkeypatch):
    monkeypatch.setattr(kernel_library, "check_cpu", lambda: None)
    fresh.mkdir()
    os.chmod(fresh, 0o775)
    with pytest.raises(kernel_library.UnsafeLibraryPath) as e:
        kernel_library.library()
    assert str(fresh) in str(e.value) and f"chmod go-w {fresh}" in str(e.value)
    assert kernel_library.DIR_ENV in str(e.value)


def test_a_directory_of_another_user_is_refused(fresh, monkeypatch):
    monkeypatch.setattr(kernel_library, "check_cpu", lambda: None)
    fresh.mkdir(mode=0o700)
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(fresh).st_uid + 1)
    with pytest.raises(kernel_library.UnsafeLibraryPath, match="not by this user"):
        kernel_library.library()


def test_a_world_writable_library_file_is_refused(fresh, monkeypatch):
    monkeypatch.setattr(kernel_library, "check_cpu", lambda: None)
    path = _planted(fresh, 0o666)
    with pytest.raises(kernel_library.UnsafeLibraryPath) as e:
        kernel_library.library()
    assert str(path) in str(e.value)


def test_a_linked_library_file_is_refused(fresh, monkeypatch, tmp_path):
    monkeypatch.setattr(kernel_library, "check_cpu", lambda: None)
    path = _planted(fresh, 0o755)
    elsewhere = tmp_path / "elsewhere.so"
    path.rename(elsewhere)
    path.symlink_to(elsewhere)
    with pytest.raises(kernel_library.UnsafeLibraryPath, match="not a regular file|neither"):
        kernel_library.library()


def test_directories_it_creates_are_private_whatever_the_umask(fresh, monkeypatch):
    monkeypatch.setattr(kernel_library, "check_cpu", lambda: None)

    def fake_compile(cc, dest):
        dest.write_bytes(b"")
        os.chmod(dest, 0o755)

    monkeypatch.setattr(kernel_library, "_compile", fake_compile)
    old = os.umask(0o002)
    try:
        path, _ = kernel_library.build()
    finally:
        os.umask(old)
    for p in (fresh, path.parent):
        assert os.stat(p).st_mode & 0o077 == 0, oct(os.stat(p).st_mode)


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
    assert lines["backend"].split()[0] == kernel_library.backend()
    assert str(BUILT) in lines["library"]
    assert "avx2" in lines["cpu"] and re.search(r"= [\d.]+ GB/s on 1 thread", lines["gemm"])


def test_the_kernels_command_fails_clearly_where_kernels_cannot_load(tmp_path):
    unsafe = tmp_path / "shared"
    unsafe.mkdir()
    os.chmod(unsafe, 0o777)
    done = _kernels_cli({kernel_library.DIR_ENV: str(unsafe)})
    assert done.returncode == 1
    try:
        kernel_library.check_cpu()
    except kernel_library.KernelsUnavailable as e:  # a CPU without kernels says so first
        assert str(e) in done.stderr
    else:
        assert f"refusing to load the CPU kernels from {unsafe}" in done.stderr
    assert "float weights" in done.stderr


def test_the_kernels_build_wherever_the_cpu_and_a_compiler_allow():
    """Kernel tests skip where the kernels cannot run: on a machine that can run them, a
    library that fails to build (a broken header, a bad merge) must fail here, not turn every
    bit-identity test into a skip."""
    try:
        kernel_library.check_cpu()
        kernel_library.compiler()
    except kernel_library.KernelsUnavailable as e:
        pytest.skip(f"this machine cannot run the kernels: {e}")
    assert kernel_library.unavailable() is None
