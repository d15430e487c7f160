"""The test session's cache (tests/session_cache.py): it reads the user's models where they lie,
and nothing a test writes there (a tiny model's quantised weights or export, a memo, a link, a
replaced or deleted entry, the cache's removal at the end) changes the user's cache, but a first
download of a real model."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from specsplit.shared.build_steps import cache_dir
from specsplit.shared.weights.sources import DRAFT_DEFAULT, SOURCES
from tests.session_cache import session_cache


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its bytes (None for a directory)."""
    return {
        str(p.relative_to(root)): None if p.is_dir() else p.read_bytes()
        for p in sorted(root.rglob("*"))
    }


def user_cache(root: Path) -> Path:
    files = {
        "quantized/real-int4.pt": b"real target",
        "quantized/content-hashes.json": b'{"real": 1}',
        "onnx/draft-int4-g3/model.onnx": b"real draft",
        "onnx/.content-keys.json": b'{"real": 2}',
        "edge/links.json": b'{"127.0.0.1:50051": {}}',
        "gguf/draft.gguf": b"GGUF",
        "hf/draft/config.json": b"{}",
        "kernels/abc/libspecsplit_kernels.so": b"ELF",
        "locks/quantized-real.lock": b"",
    }
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def test_the_user_cache_is_read_and_never_written(tmp_path):
    real = user_cache(tmp_path / "real")
    made = snapshot(real)
    cache = session_cache(real)
    before = snapshot(real)
    # Made in the user's cache: what its first download would make (the lock files that guard
    # the real models' downloads, the download directories), empty.
    downloads = {f"locks/{s.name}.{step}.lock" for s in SOURCES.values() for step in ("gguf", "hf")}
    assert set(before) - set(made) <= downloads | {"wheels"}
    assert all(not before[name] for name in set(before) - set(made))
    try:
        # the user's models, read where they lie
        assert (cache / "quantized" / "real-int4.pt").read_bytes() == b"real target"
        assert (cache / "onnx" / "draft-int4-g3" / "model.onnx").read_bytes() == b"real draft"
        assert (cache / "gguf" / "draft.gguf").read_bytes() == b"GGUF"
        assert (cache / "kernels" / "abc" / "libspecsplit_kernels.so").is_file()
        assert (cache / "quantized" / "content-hashes.json").read_bytes() == b'{"real": 1}'
        assert not (cache / "edge" / "links.json").exists()  # the servers tests start are new
        # what tests write
        (cache / "quantized" / "tiny-int8.pt").write_bytes(b"tiny")
        (cache / "quantized" / "content-hashes.json").write_bytes(b'{"tiny": 1}')
        (cache / "onnx" / "tiny-int4-g3").mkdir()
        (cache / "onnx" / ".content-keys.json").write_bytes(b'{"tiny": 2}')
        (cache / "edge" / "links.json").write_bytes(b'{"127.0.0.1:40000": {}}')
        (cache / "locks" / "quantized-tiny.lock").touch()
        newer = cache / "quantized" / "newer.tmp"
        newer.write_bytes(b"newer")
        os.replace(newer, cache / "quantized" / "real-int4.pt")  # a newer entry replaces it
        (cache / "onnx" / "draft-int4-g3").unlink()  # an entry deleted
        assert snapshot(real) == before
    finally:
        shutil.rmtree(cache)
    assert snapshot(real) == before  # removing the session's cache leaves the user's whole


def test_a_first_download_lands_in_the_user_cache(tmp_path):
    """Weights fetched for a real model are kept for the next session (and the user)."""
    real = tmp_path / "real"
    cache = session_cache(real)
    try:
        (cache / "gguf" / "target.gguf").write_bytes(b"GGUF")
        (cache / "hf" / "target").mkdir()
    finally:
        shutil.rmtree(cache)
    assert (real / "gguf" / "target.gguf").read_bytes() == b"GGUF"
    assert (real / "hf" / "target").is_dir()


def test_a_real_models_download_takes_the_user_caches_lock(tmp_path):
    real = tmp_path / "real"
    cache = session_cache(real)
    try:
        lock = cache / "locks" / f"{DRAFT_DEFAULT.name}.gguf.lock"
        assert lock.resolve() == (real / "locks" / lock.name).resolve()
    finally:
        shutil.rmtree(cache)


def test_this_session_runs_on_its_own_cache(real_cache):
    assert cache_dir() != real_cache
    assert os.environ["SPECSPLIT_CACHE"] == os.environ["SPECSPLIT_TEST_CACHE"] == str(cache_dir())
    assert (cache_dir() / "edge").is_dir() and not (cache_dir() / "edge").is_symlink()
