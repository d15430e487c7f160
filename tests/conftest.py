"""Shared fixtures: tiny models (target, unrelated draft) with ONNX exports, a real cloud; and
the session's own model cache.

The test session runs on a cache of its own (``SPECSPLIT_CACHE``, set before any test module is
imported, inherited by every process the tests start), so what tiny and temporary models leave
(``quantized/`` entries, exports in ``onnx/`` and its digest memo, ``edge/links.json``, their
locks) never lands in the user's cache, and goes when the session ends. What the real models
need is read from the user's cache where it lies (``REAL_CACHE``), never fetched again: the
downloaded and converted weights (``wheels/``, ``gguf/``, ``hf/``), the compiled kernels and
other builds are linked whole, so a first download still lands there; the real draft's exports
and the real target's quantised weights are linked entry by entry, so new entries (a tiny
model's) stay in the session's cache (tests/session_cache.py; README, "Cache: layout, cleanup,
uninstall"). ``SPECSPLIT_TEST_CACHE`` names it, so a pytest run inside a test uses the same one.
"""

from __future__ import annotations

import atexit
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from specsplit.shared.build_steps import cache_dir
from tests.session_cache import session_cache

# The user's cache: ${SPECSPLIT_CACHE:-~/.cache/specsplit} as the session found it.
REAL_CACHE = cache_dir()

if os.environ.get("SPECSPLIT_TEST_CACHE") is None:
    _SESSION_CACHE = session_cache(REAL_CACHE)
    # rmtree unlinks the links and never follows them into the real cache.
    atexit.register(shutil.rmtree, _SESSION_CACHE, ignore_errors=True)
    os.environ["SPECSPLIT_TEST_CACHE"] = str(_SESSION_CACHE)  # pytest run inside a test
    os.environ["SPECSPLIT_CACHE"] = str(_SESSION_CACHE)

from specsplit.cloud.supervision.process import CloudProcess  # noqa: E402
from specsplit.shared.tiny import make_tiny_qwen2  # noqa: E402

# Servers the tests start serve the target's float path, the one whose greedy output must equal
# transformers' (the reference these tests compare with). The quantised paths have their own
# tests, against the served target's own cloud-only output (tests/test_quantized_target.py).
os.environ.setdefault("SPECSPLIT_TARGET_WEIGHTS", "float")


@pytest.fixture(scope="session")
def real_cache() -> Path:
    """The user's cache, where the real models lie (read it; the session writes its own)."""
    return REAL_CACHE


@dataclass(frozen=True)
class TinyModels:
    target: Path  # HF dir
    draft: Path  # HF dir, unrelated weights (mostly rejected)
    target_onnx: Path  # the target itself as a draft: everything accepted
    draft_onnx: Path


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> TinyModels:
    from specsplit.edge.export.exporter import export_onnx

    root = tmp_path_factory.mktemp("tiny")
    target = make_tiny_qwen2(root / "target", seed=0)
    draft = make_tiny_qwen2(root / "draft", seed=1)
    return TinyModels(
        target=target,
        draft=draft,
        target_onnx=export_onnx(target, root / "target-onnx"),
        draft_onnx=export_onnx(draft, root / "draft-onnx"),
    )


@pytest.fixture(scope="session")
def cloud(tiny, tmp_path_factory):
    """`specsplit-cloud serve` with the tiny target: real tritonserver + gateway on free ports."""
    with CloudProcess("--target", str(tiny.target), log_dir=tmp_path_factory.mktemp("cloud")) as c:
        yield c


@pytest.fixture
def lock_step_first(monkeypatch):
    """Auto plans start as they did before a cold client started cloud-led: lock-step unless
    the remembered link says cloud-led (edge.session_plan._leads_from_start). For tests of the
    lock-step rounds, the switch and the cloud's lead, which a cold client no longer runs."""
    from specsplit.edge import session_plan

    def link_says(link) -> bool:
        return link is not None and link.starts_led()

    monkeypatch.setattr(session_plan, "_leads_from_start", link_says)
