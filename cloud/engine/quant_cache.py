"""Quantised target weights kept on disk, so a restart loads them in seconds, not minutes.

Quantising the 1.5B target (finding each 4-bit group's own grid) takes about a minute on one
core; every Triton start (tests, a supervisor's restart, a replica) would pay it. The result is
stored under ``cache_dir()/quantized/<key>.pt`` and loaded with mmap, in the natural layout
(``cloud.engine.kernel_layouts``): whichever kernel the CPU runs packs it at load. The key covers
everything the result depends on: the model's config and weight files (by content, so a copied
cache still finds its entries), the format, and the source of the quantiser
(``cloud.engine.quantized``); a changed file or quantiser makes a new entry. A change to the
kernels or their layouts alone keeps the entry.
An entry is ~1.2 GB for the 1.5B target, so saving one removes the older entries of the same
model and format (the key's first part), which no load can ask for again. A GGUF source served
at its own widths (``--weights gguf``) keeps its blocks in the natural layout the same way
(converting them from the file takes ~30 s for the 1.5B target).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

from specsplit.cloud.engine import quantized
from specsplit.shared.steps import cache_dir, locked

log = logging.getLogger(__name__)


_SAMPLE = 1 << 20  # bytes read at the start, middle and end of each weight file


def _fingerprint(path: Path) -> str:
    """A weight file's size and the sha256 of three 1 MiB samples: its content, cheaply, and
    the same wherever the file is copied (a path or an mtime would not be)."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as fh:
        for at in (0, max(0, size // 2 - _SAMPLE // 2), max(0, size - _SAMPLE)):
            fh.seek(at)
            digest.update(fh.read(_SAMPLE))
    return digest.hexdigest()


def key(
    model_dir: str | Path, weights: str, four_bit: bool, gguf_path: str | Path | None = None
) -> str:
    """``<model and format>-<weight files and quantiser>``: the first part names the slot a
    newer entry replaces. Both come from content (the config, samples of the weight files and
    of the GGUF the weights are read from, if any), so a model directory or cache copied to
    another path finds its entry."""
    model_dir = Path(model_dir).resolve()
    config = (model_dir / "config.json").read_bytes()
    weight_files = [p for p in model_dir.iterdir() if p.suffix in (".safetensors", ".bin")]
    files = sorted((p.name, _fingerprint(p)) for p in weight_files)
    if gguf_path is not None:
        files.append(("gguf", _fingerprint(Path(gguf_path))))
    slot = hashlib.sha256(config + json.dumps([weights, four_bit]).encode()).hexdigest()
    quantiser = b"".join(Path(m.__file__).read_bytes() for m in _quantisers())
    facts = hashlib.sha256(json.dumps(files).encode() + quantiser).hexdigest()
    return f"{slot[:12]}-{facts[:12]}"


def _quantisers() -> list:
    """The modules whose code decides what an entry holds."""
    from specsplit.cloud.engine import formats, gguf_weights

    mods = [quantized, formats, gguf_weights]
    for name in ("kquants", "block_quants"):
        try:
            mods.append(importlib.import_module(f"specsplit.cloud.engine.{name}"))
        except ImportError:
            continue
    return mods


def _path(cache_key: str) -> Path:
    return cache_dir() / "quantized" / f"{cache_key}.pt"


def load(cache_key: str):
    """(layers, lm_head) as ``save`` stored them, or None."""
    path = _path(cache_key)
    if not path.is_file():
        return None
    try:
        state = torch.load(path, mmap=True, weights_only=True)
    except Exception as e:  # a torn or foreign file: quantise again
        log.warning("ignoring the quantised weights at %s: %s", path, e)
        return None
    log.info("quantised weights from %s", path)
    layers = [
        {name: quantized.QuantLinear.from_state(s) for name, s in layer.items()}
        for layer in state["layers"]
    ]
    return layers, quantized.QuantLinear.from_state(state["lm_head"])


def save(cache_key: str, layers, lm_head) -> None:
    path = _path(cache_key)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "layers": [{name: lin.state() for name, lin in layer.items()} for layer in layers],
        "lm_head": lm_head.state(),
    }
    with locked(f"quantized-{cache_key}"):
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        os.close(fd)
        try:
            torch.save(state, tmp)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    log.info("kept the quantised weights at %s", path)
    _drop_older(path)


def _drop_older(path: Path) -> None:
    """Removes the other entries of ``path``'s slot (same model directory and format)."""
    slot = path.stem.split("-", 1)[0]
    for old in path.parent.glob(f"{slot}-*.pt"):
        if old != path:
            old.unlink(missing_ok=True)
            log.info("removed the outdated quantised weights at %s", old)
