"""The test session's own model cache, made from the user's (tests/conftest.py uses it): new
entries stay in it, the real models are read from the user's cache where they lie."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from specsplit.shared.weights.sources import SOURCES

# Entries linked one by one: the user's are read, new ones (tiny models') stay in the session's.
PER_ENTRY = ("onnx", "quantized")
# Memos that tiny models' paths would be added to: copied, not linked.
MEMOS = {"onnx": (".content-keys.json",), "quantized": ("content-hashes.json",)}
# Made fresh: what only the session's own servers and models put there.
FRESH = ("edge", "locks")


def session_cache(real: Path) -> Path:
    """A new temporary cache that reads ``real``'s models as described above."""
    cache = Path(tempfile.mkdtemp(prefix="specsplit-test-cache-"))
    for name in FRESH:
        (cache / name).mkdir()
    # The locks that guard writes into the linked real entries are the real ones, so this
    # session and any other user of the real cache never rebuild one file at once.
    (real / "locks").mkdir(parents=True, exist_ok=True)
    for source in SOURCES.values():
        for lock in (f"{source.name}.gguf.lock", f"{source.name}.hf.lock"):
            (real / "locks" / lock).touch()
            (cache / "locks" / lock).symlink_to(real / "locks" / lock)
    entries = sorted(real.iterdir()) if real.is_dir() else []
    for entry in entries:
        if entry.name in FRESH:
            continue
        if entry.name not in PER_ENTRY:
            (cache / entry.name).symlink_to(entry)
            continue
        (cache / entry.name).mkdir()
        for child in entry.iterdir():
            if child.name in MEMOS[entry.name]:
                shutil.copy2(child, cache / entry.name / child.name)
            elif not child.name.startswith("."):  # another writer's temporary file
                (cache / entry.name / child.name).symlink_to(child)
    for name in ("wheels", "gguf", "hf"):  # a first download lands in the real cache
        if not (cache / name).exists():
            (real / name).mkdir(parents=True, exist_ok=True)
            (cache / name).symlink_to(real / name)
    return cache
