"""A model given as a bare GGUF file (``specsplit-cloud serve --target model.gguf``).

It takes the path the default pair's verified GGUFs take (``shared.weights.sources``): converted
once into a Hugging Face directory in the cache (``_build_hf_dir``, the same conversion), which
the target then serves with the file as its GGUF source (``cloud.engine.gguf_weights``), so
``--weights auto`` weighs the file's own blocks against the float path as it does for the
default target.

Contract:
- ``resolve_gguf(path)`` returns ``cache_dir()/hf/<file stem>-<sha256[:12]>``, converted on first
  use, holding ``source.gguf``: a link to ``path`` (renewed on every call, so the file may move).
  The directory is found by the file's content, not its path or name: a copied or renamed file,
  or a copied cache, converts nothing again (the stem stays the first file's). The file's own
  end-of-sequence token ends generations (the default pair's sources name theirs); a chat
  template is not required (the edge renders prompts).
- A file whose content is a default source's (the official GGUF, anywhere) is that source:
  linked into ``gguf/`` where the cache lacks it, and converted once into its usual directory.
- ``check_gguf(path)`` refuses a missing file, a directory or a file that is not a GGUF with a
  ``ValueError`` that says so and what ``--target`` takes.

Imports neither torch nor transformers at import time; converting needs the cloud extra's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from specsplit.shared.build_steps import cache_dir, content_sha256, locked, require_extra
from specsplit.shared.weights import sources

MAGIC = b"GGUF"  # every GGUF file's first four bytes (the format's magic)
LINK = "source.gguf"  # in the converted directory: the GGUF it came from
TAKES = "--target takes a .gguf file, a Hugging Face model directory or a default model name"


@dataclass(frozen=True)
class LocalGguf:
    """A GGUF file outside the default sources, as ``sources._build_hf_dir`` converts it."""

    name: str  # the converted directory's name under cache_dir()/hf
    path: Path
    sha256: str
    eos_tokens: tuple[str, ...] = ()  # none named: the file's own eos token
    pad_token: str | None = None  # none: the file's own, else the eos token
    needs_chat_template = False  # a target's prompts are rendered by the edge


def looks_like_gguf(spec: str | Path) -> bool:
    """Whether ``--target`` names a file (a ``.gguf`` name, or any existing file)."""
    path = Path(spec).expanduser()
    return path.suffix.lower() == ".gguf" or path.is_file()


def check_gguf(path: str | Path) -> Path:
    """``path`` if it is a readable GGUF file; ValueError saying what it is instead."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise ValueError(f"{path} is a directory without config.json, not a GGUF file: {TAKES}")
    if not path.exists():
        raise ValueError(f"{path}: no such file ({TAKES})")
    with open(path, "rb") as fh:  # OSError (unreadable) is the CLI's to report
        head = fh.read(len(MAGIC))
    if head != MAGIC:
        raise ValueError(
            f"{path} is not a GGUF file (it starts with {head!r}, a GGUF with {MAGIC!r}): {TAKES}"
        )
    return path


def _sha256(path: Path) -> str:
    """The file's sha256 (``shared.build_steps.content_sha256``), remembered in
    ``hf/.gguf-hashes.json``: a large GGUF hashes in seconds, once."""
    return content_sha256(path, cache_dir() / "hf" / ".gguf-hashes.json")


def _link(link: Path, to: Path) -> None:
    """``link`` -> ``to``, replaced in one step (a reader never sees it missing)."""
    tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(to)
    os.replace(tmp, link)


def _as_default_source(path: Path, source) -> Path:
    """The official GGUF of a default source, given by path: into ``gguf/`` (linked) where the
    cache lacks it, then the source's usual conversion."""
    if sources.cached_gguf(source) is None:
        cached = cache_dir() / "gguf" / source.gguf_file
        cached.parent.mkdir(parents=True, exist_ok=True)
        with locked(f"{source.name}.gguf"):
            _link(cached, path.resolve())
            sources._write_marker(cached, source)
    return sources.ensure_hf_dir(source)


def resolve_gguf(path: str | Path, progress: bool = True) -> Path:
    """The Hugging Face directory converted from the GGUF at ``path`` (see the contract)."""
    path = check_gguf(path)
    digest = _sha256(path)
    for source in sources.SOURCES.values():
        if source.sha256 == digest and source.size == path.stat().st_size:
            return _as_default_source(path, source)
    source = _converted(digest, path) or LocalGguf(
        name=f"{path.stem}-{digest[:12]}", path=path, sha256=digest
    )
    dest = sources.hf_dir_path(source)
    with locked(f"{source.name}.hf"):
        if not sources._hf_is_complete(dest, source):
            require_extra("cloud", "torch", "transformers", "gguf", "safetensors")
            sources._build_hf_dir(source, path, dest, progress)
        _link(dest / LINK, path.resolve())
    return dest


def _converted(digest: str, path: Path) -> LocalGguf | None:
    """The source of a directory already converted from this content, under whatever file name
    it had then (``<stem>-<sha256[:12]>``)."""
    for found in sorted((cache_dir() / "hf").glob(f"*-{digest[:12]}")):
        source = LocalGguf(name=found.name, path=path, sha256=digest)
        if sources._hf_is_complete(found, source):
            return source
    return None
