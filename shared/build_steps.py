"""Helpers for the long build steps (fetch, convert, export): where they cache, how they key a
cache by a file's content, how they show progress, how concurrent processes take turns, and what
they need installed.

rich is imported lazily, like torch: an edge install that runs a pulled draft need not have it.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


def cache_dir() -> Path:
    """``$SPECSPLIT_CACHE``, default ``~/.cache/specsplit``: models, exports, locks."""
    return Path(os.environ.get("SPECSPLIT_CACHE") or Path.home() / ".cache" / "specsplit")


def content_sha256(path: Path, memo_path: Path) -> str:
    """The sha256 of ``path``'s content: the same wherever the file is copied (a path or an
    mtime would not be). Hashing a GB-sized file takes seconds, so each result is remembered per
    (resolved path, size, mtime) in the JSON file ``memo_path``: a copied file hashes once."""
    st = path.stat()
    stamp = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    if not isinstance(memo, dict):
        memo = {}
    if isinstance(memo.get(stamp), str):
        return memo[stamp]
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(8 << 20):
            digest.update(chunk)
    memo[stamp] = digest.hexdigest()
    memo_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=memo_path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as out:
        json.dump(memo, out)
    os.replace(tmp, memo_path)
    return memo[stamp]


def progress_bar(enabled: bool, *columns: object):
    """A rich progress display on stderr (default columns: bar and N/M); off when not enabled."""
    from rich import progress as rp
    from rich.console import Console

    columns = columns or (*rp.Progress.get_default_columns(), rp.MofNCompleteColumn())
    return rp.Progress(*columns, console=Console(stderr=True), disable=not enabled)


def byte_progress(enabled: bool):
    from rich import progress as rp

    cols = (rp.TextColumn("{task.description}"), rp.BarColumn(), rp.DownloadColumn())
    return progress_bar(enabled, *cols, rp.TransferSpeedColumn(), rp.TimeRemainingColumn())


def spinner(enabled: bool):
    """A rich spinner with elapsed time on stderr, for steps without a measurable total."""
    from rich import progress as rp

    cols = (rp.SpinnerColumn(), rp.TextColumn("{task.description}"), rp.TimeElapsedColumn())
    return progress_bar(enabled, *cols)


@contextlib.contextmanager
def locked(name: str) -> Iterator[None]:
    """Exclusive inter-process lock; a no-op where fcntl is missing (Windows edge installs)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    lock_dir = cache_dir() / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / f"{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# What to run, from the repository root of a checkout (specsplit is not published on PyPI yet).
CPU_TORCH = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"


def install_hint(extra: str) -> str:
    """The command that installs ``extra``: from a checkout, CPU torch first where it is needed."""
    torch_first = f"(on a machine without a GPU, first `{CPU_TORCH}`)" if extra != "edge" else ""
    return f"`pip install -e '.[{extra}]'` from the specsplit repository root {torch_first}".strip()


def require_extra(extra: str, *modules: str) -> None:
    """Raises ImportError naming the pip extra when one of ``modules`` is not installed."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(
            f"{', '.join(missing)} not installed; this step needs the {extra!r} extra: "
            f"{install_hint(extra)}"
        )
