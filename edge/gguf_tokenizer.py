"""A default draft's tokenizer read from its verified GGUF alone, for a cloud-only text prompt.

A cloud-only generation drafts nothing: it needs the draft's tokenizer and nothing else. Where
the cache holds neither an export nor the converted Hugging Face directory (``hf/`` deleted, or
only the official GGUF placed in ``gguf/``: README, "Cache"), converting the GGUF and exporting
the draft take minutes, while its tokenizer (vocabulary, merges, special tokens, chat template)
is in the GGUF's metadata and reads in seconds. transformers' GGUF tokenizer converter reads it
(the ``export`` extra's transformers and gguf), as ``shared.weights.gguf_convert`` does when it
converts the whole model; the result is kept under ``<cache>/tokenizers/``.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from specsplit.shared.build_steps import cache_dir, install_hint
from specsplit.shared.weights.sources import GgufChunkSource, cached_gguf


def tokenizer_dir(source: GgufChunkSource) -> Path:
    """Where the tokenizer of ``source``'s GGUF is kept: keyed by the GGUF's sha256, so a cache
    copied elsewhere still finds it and a changed source never reads an old one."""
    return cache_dir() / "tokenizers" / f"{source.name}-{source.sha256[:12]}"


def cached_gguf_tokenizer(source: GgufChunkSource) -> Path | None:
    """The tokenizer read from ``source``'s GGUF before, else None: reads nothing."""
    d = tokenizer_dir(source)
    return d if (d / "tokenizer.json").is_file() else None


def gguf_tokenizer(source: GgufChunkSource, progress: bool = True) -> Path | None:
    """The directory holding ``source``'s tokenizer, read from its verified GGUF once; None
    where the cache holds no verified GGUF of it (nothing is downloaded here).

    Raises ImportError naming the flags that avoid it and the extra that provides it when
    transformers or gguf are not installed."""
    found = cached_gguf_tokenizer(source)
    if found is not None:
        return found
    gguf = cached_gguf(source)
    if gguf is None:
        return None
    missing = [m for m in ("transformers", "gguf") if not _installed(m)]
    if missing:
        raise ImportError(
            f"a text prompt needs the draft's tokenizer, which {gguf} holds; reading it needs "
            f"{' and '.join(missing)} ({install_hint('export')}). Or give --prompt-ids, or "
            "--draft DIR with a tokenizer.json"
        )
    if progress:
        print(f"reading the tokenizer from {gguf} (once) ...", file=sys.stderr, flush=True)
    return _write(source, gguf)


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def read_tokenizer(gguf: Path, out: Path) -> None:
    """Writes the tokenizer in ``gguf``'s metadata into ``out`` (tokenizer.json, its config and
    chat template) as transformers converts it."""
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)


def _write(source: GgufChunkSource, gguf: Path) -> Path:
    """Reads the tokenizer into a temporary sibling, then renames it into place in one step, so
    a reader never sees half of one and two writers leave one whole."""
    dest = tokenizer_dir(source)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    try:
        read_tokenizer(gguf, tmp)
        for path in [tmp, *tmp.iterdir()]:  # readable by another user, as the cache's hf/ is
            path.chmod(0o755 if path.is_dir() else 0o644)
        try:
            os.replace(tmp, dest)
        except OSError:  # another process put one there first: keep it
            if cached_gguf_tokenizer(source) is None:
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
