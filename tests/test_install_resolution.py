"""`pip install 'specsplit[edge]'` on each platform the edge runs on, checked from this machine.

The edge extras (pyproject.toml) choose their ONNX Runtime distribution by environment markers:
the markers are evaluated here with ``packaging.markers`` for each platform's environment, and
the requirements they select are resolved against the package index with pip's
``--dry-run --report - --platform ... --only-binary=:all: --no-deps``, so a platform that loses
its wheels fails the test. pip does not widen a ``manylinux_2_X`` tag to the older tags a glibc
2.X machine also takes, so each platform lists its tags in full. pip runs with no configuration
(``PIP_CONFIG_FILE`` = devnull, no ``PIP_*`` variables): a machine's own indexes or constraints do
not change the answer. ``SPECSPLIT_TEST_INDEX_URL`` points it at a mirror; the resolution tests
skip, saying so, only when the index cannot be reached.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11+")

ROOT = Path(__file__).resolve().parents[1]
INDEX = os.environ.get("SPECSPLIT_TEST_INDEX_URL", "https://pypi.org/simple/")
PYTHON = "3.11"
ORT = {"onnxruntime", "onnxruntime-gpu"}  # both install the module `onnxruntime`: never both


def manylinux(glibc_minor: int, arch: str) -> tuple[str, ...]:
    """Every manylinux tag a glibc 2.<glibc_minor> machine of ``arch`` installs."""
    tags = [f"manylinux_2_{m}_{arch}" for m in range(glibc_minor, 16, -1)]
    return (*tags, f"manylinux2014_{arch}")


@dataclass(frozen=True)
class Platform:
    sys_platform: str
    platform_machine: str
    platform_system: str
    os_name: str
    tags: tuple[str, ...]
    edge_ort: str  # the ONNX Runtime distribution `edge` must pick there
    cuda: bool  # onnxruntime-gpu has a wheel there (`edge-cuda` resolves)

    def environment(self, extra: str) -> dict[str, str]:
        return {
            "sys_platform": self.sys_platform,
            "platform_machine": self.platform_machine,
            "platform_system": self.platform_system,
            "os_name": self.os_name,
            "python_version": PYTHON,
            "python_full_version": f"{PYTHON}.0",
            "implementation_name": "cpython",
            "platform_python_implementation": "CPython",
            "extra": extra,
        }


PLATFORMS = {
    "linux-x86_64": Platform(
        "linux", "x86_64", "Linux", "posix", manylinux(31, "x86_64"), "onnxruntime-gpu", True
    ),
    "linux-aarch64-glibc2.31": Platform(
        "linux", "aarch64", "Linux", "posix", manylinux(31, "aarch64"), "onnxruntime", False
    ),
    "linux-aarch64-glibc2.34": Platform(
        "linux", "aarch64", "Linux", "posix", manylinux(34, "aarch64"), "onnxruntime", True
    ),
    "macos-arm64": Platform(
        "darwin", "arm64", "Darwin", "posix", ("macosx_14_0_arm64",), "onnxruntime", False
    ),
    "windows-x86_64": Platform(
        "win32", "AMD64", "Windows", "nt", ("win_amd64",), "onnxruntime-gpu", True
    ),
}
EDGE_EXTRAS = ("edge", "edge-cpu", "edge-cuda")


@functools.cache
def extras() -> dict[str, list[Requirement]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {k: [Requirement(r) for r in v] for k, v in project["optional-dependencies"].items()}


def selected(extra: str, platform: Platform) -> list[Requirement]:
    """The extra's requirements whose markers hold on ``platform``."""
    env = platform.environment(extra)
    return [r for r in extras()[extra] if r.marker is None or r.marker.evaluate(env)]


def ort_of(requirements: list[Requirement]) -> list[str]:
    return [canonicalize_name(r.name) for r in requirements if canonicalize_name(r.name) in ORT]


@pytest.mark.parametrize("name", PLATFORMS)
def test_each_platform_gets_exactly_one_onnxruntime(name):
    platform = PLATFORMS[name]
    assert ort_of(selected("edge", platform)) == [platform.edge_ort]
    assert ort_of(selected("edge-cpu", platform)) == ["onnxruntime"]
    assert ort_of(selected("edge-cuda", platform)) == ["onnxruntime-gpu"]


def test_the_edge_extras_differ_only_in_onnxruntime():
    rest = {
        extra: sorted(str(r) for r in extras()[extra] if canonicalize_name(r.name) not in ORT)
        for extra in EDGE_EXTRAS
    }
    assert rest["edge"] == rest["edge-cpu"] == rest["edge-cuda"]


@pytest.fixture(scope="module")
def index() -> str:
    try:
        with urllib.request.urlopen(f"{INDEX.rstrip('/')}/onnxruntime/", timeout=15):
            pass
    except (urllib.error.URLError, OSError) as e:
        pytest.skip(f"the package index {INDEX} cannot be reached from here: {e}")
    return INDEX


def pip_dry_run(requirements: list[Requirement], platform: Platform, index: str):
    """pip installing ``requirements`` (no dependencies) on ``platform``, dry: (exit status,
    its JSON report or its errors)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    tags = [arg for tag in platform.tags for arg in ("--platform", tag)]
    cmd = [
        sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input",
        "install", "--dry-run", "--quiet", "--report", "-", "--ignore-installed", "--no-deps",
        "--only-binary=:all:", "--python-version", PYTHON, "--implementation", "cp",
        *tags, "--index-url", index, *(str(r) for r in requirements),
    ]  # fmt: skip
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    return r.returncode, json.loads(r.stdout) if r.returncode == 0 else r.stderr


def wanted(platform: Platform) -> list[Requirement]:
    """`edge`, `edge-cpu` and `webgpu` everywhere, `edge-cuda` where onnxruntime-gpu has wheels:
    their requirements on ``platform``, each once, without markers (pip would evaluate them for
    this machine, not for ``platform``)."""
    extras_ = ["edge", "edge-cpu", "webgpu"] + (["edge-cuda"] if platform.cuda else [])
    requirements: dict[str, Requirement] = {}
    for r in (r for extra in extras_ for r in selected(extra, platform)):
        r = Requirement(str(r))
        r.marker = None
        requirements[str(r)] = r
    return list(requirements.values())


GPU_ONLY = Requirement("onnxruntime-gpu>=1.31")
NO_GPU_WHEEL = ("linux-aarch64-glibc2.31", "macos-arm64")


@pytest.fixture(scope="module")
def resolved(index) -> dict:
    """Every pip call these tests make, at once (each waits on the index, not the CPU):
    platform name -> pip's answer for ``wanted``, and (name, "gpu") -> for onnxruntime-gpu."""
    calls = {name: (wanted(p), p) for name, p in PLATFORMS.items()}
    calls |= {(name, "gpu"): ([GPU_ONLY], PLATFORMS[name]) for name in NO_GPU_WHEEL}
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = {key: pool.submit(pip_dry_run, *call, index) for key, call in calls.items()}
        return {key: future.result() for key, future in futures.items()}


@pytest.mark.parametrize("name", PLATFORMS)
def test_the_edge_extras_resolve_on_each_platform(name, resolved):
    platform = PLATFORMS[name]
    status, report = resolved[name]
    assert status == 0, f"pip could not resolve the edge extras for {name}:\n{report}"
    got = {canonicalize_name(i["metadata"]["name"]): i for i in report["install"]}
    for r in wanted(platform):
        assert canonicalize_name(r.name) in got, f"{r} was not resolved for {name}"
        assert r.specifier.contains(got[canonicalize_name(r.name)]["metadata"]["version"], True)
    for dist in ORT & got.keys():
        wheel = got[dist]["download_info"]["url"].rsplit("/", 1)[-1]
        assert wheel.endswith(".whl") and any(tag in wheel for tag in platform.tags), wheel


@pytest.mark.parametrize("name", NO_GPU_WHEEL)
def test_onnxruntime_gpu_has_no_wheel_for_old_glibc_aarch64_or_macos(name, resolved):
    """Why `edge` gives Linux aarch64 and macOS the plain build: should onnxruntime-gpu publish
    wheels for them, this fails, and the markers can widen."""
    status, errors = resolved[name, "gpu"]
    assert status != 0 and "No matching distribution found for onnxruntime-gpu" in errors
