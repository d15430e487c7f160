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

A loaded entry is checked against the model and the format (``Expected``: every tensor's dtype
and shape, as the kernels' formats in ``cloud.engine.kernel_layouts`` fix them) before any of
its pointers can reach C: the file is ours, but the directory may be shared or the file torn or
from another version, and a wrong shape would make the kernels read past a tensor's end. An
entry that does not match is discarded with a WARNING, and the model quantised again.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from specsplit.cloud.engine import kernel_layouts, quantized
from specsplit.shared.build_steps import cache_dir, content_sha256, locked

log = logging.getLogger(__name__)


def _fingerprint(path: Path) -> str:
    """The sha256 of a weight file's content (``shared.build_steps.content_sha256``),
    remembered in ``quantized/content-hashes.json``."""
    return content_sha256(path, cache_dir() / "quantized" / "content-hashes.json")


def key(
    model_dir: str | Path, weights: str, four_bit: bool, gguf_path: str | Path | None = None
) -> str:
    """``<model and format>-<weight files and quantiser>``: the first part names the slot a
    newer entry replaces. Both come from content (the config, the weight files and the GGUF the
    weights are read from, if any), so a model directory or cache copied to
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


@dataclass(frozen=True)
class Expected:
    """What an entry must hold for a model and format: per layer, each fused linear's (output
    features, input features); the LM head's; the format (``int8``: every part int8; ``int4``:
    parts int4 or int8; ``gguf``: parts in GGUF formats or int8)."""

    layers: tuple[dict[str, tuple[int, int]], ...]
    lm_head: tuple[int, int]
    weights: str


def _part_layout(fmt: str, n: int, k: int) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """The natural layout's tensors of one part of ``fmt`` (``cloud.engine.formats``): (name,
    dtype, shape)."""
    groups = k // kernel_layouts.GROUP
    if fmt == "int8":
        blocks = groups // kernel_layouts.per_block(k)
        return [
            ("q", torch.int8, (n, k)),
            ("sc", torch.uint8, (n, groups)),
            ("d", torch.float32, (n, blocks)),
        ]
    if fmt == "int4":
        blocks = groups // kernel_layouts.per_block(k)
        return [
            ("packed", torch.uint8, (n, k // 2)),
            ("sc", torch.int16, (n, groups)),
            ("d", torch.float32, (n, blocks)),
            ("mn", torch.int16, (n, groups)),
            ("dm", torch.float32, (n, blocks)),
        ]
    from specsplit.cloud.engine.gguf_weights import synthetic

    # a GGUF format's tensors all run along the rows: one row shows their dtypes and widths
    return [(f"tensor {i}", t.dtype, (n, *t.shape[1:])) for i, t in enumerate(synthetic(fmt, 1, k))]


def _check_linear(state, shape: tuple[int, int], allowed: tuple[str, ...], where: str):
    """Raises ValueError unless ``state`` (QuantLinear.state()) is a linear of ``shape``."""
    n_total, k = shape
    kernel_layouts.check_width(k)
    if not isinstance(state, dict) or set(state) != {"parts", "bias"}:
        raise ValueError(f"{where}: not a quantised linear")
    parts = state["parts"]
    if not isinstance(parts, list) or not parts:
        raise ValueError(f"{where}: no parts")
    rows = 0
    for i, part in enumerate(parts):
        if not (isinstance(part, list) and len(part) == 2 and part[0] in allowed):
            raise ValueError(f"{where} part {i}: not [a format of {allowed}, tensors]")
        fmt, tensors = part
        first = tensors[0] if isinstance(tensors, list) and tensors else None
        if not isinstance(first, torch.Tensor) or first.dim() != 2 or first.shape[0] < 1:
            raise ValueError(f"{where} part {i}: no [rows, ...] weights")
        n = first.shape[0]
        layout = _part_layout(fmt, n, k)
        if len(tensors) != len(layout):
            raise ValueError(f"{where} part {i}: {fmt} parts hold {len(layout)} tensors")
        for t, (name, dtype, want) in zip(tensors, layout, strict=True):
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != want:
                got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t)
                raise ValueError(f"{where} part {i}: {name} is {got}, not {dtype} {list(want)}")
        rows += n
    if rows != n_total:
        raise ValueError(f"{where}: {rows} output features, the model has {n_total}")
    bias = state["bias"]
    if bias is not None and (
        not isinstance(bias, torch.Tensor)
        or bias.dtype != torch.float32
        or tuple(bias.shape) != (n_total,)
    ):
        raise ValueError(f"{where}: the bias is not float32 [{n_total}]")


def check(state, expected: Expected) -> None:
    """Raises ValueError naming the first tensor of ``state`` (as ``save`` stores it) whose
    dtype or shape the model and format do not give."""
    allowed = _formats(expected.weights)
    if not isinstance(state, dict) or set(state) != {"layers", "lm_head"}:
        raise ValueError("not a quantised-weights entry")
    layers = state["layers"]
    if not isinstance(layers, list) or len(layers) != len(expected.layers):
        count = len(layers) if isinstance(layers, list) else "no"
        raise ValueError(f"{count} layers, the model has {len(expected.layers)}")
    for li, (layer, shapes) in enumerate(zip(layers, expected.layers, strict=True)):
        if not isinstance(layer, dict) or set(layer) != set(shapes):
            raise ValueError(f"layer {li}: not the linears {sorted(shapes)}")
        for name, shape in shapes.items():
            _check_linear(layer[name], shape, allowed, f"layer {li} {name}")
    head = allowed if expected.weights == "gguf" else ("int8",)
    _check_linear(state["lm_head"], expected.lm_head, head, "lm_head")


def _formats(weights: str) -> tuple[str, ...]:
    """The part formats an entry of ``weights`` may hold (the LM head aside)."""
    if weights == "int8":
        return ("int8",)
    if weights == "int4":
        return ("int4", "int8")
    from specsplit.cloud.engine import formats

    return ("int8", *formats.gguf_formats())


def load(cache_key: str, expected: Expected):
    """(layers, lm_head) as ``save`` stored them, or None: none kept, or one that does not
    match ``expected`` (then discarded, with a WARNING)."""
    path = _path(cache_key)
    if not path.is_file():
        return None
    try:
        state = torch.load(path, mmap=True, weights_only=True)
        check(state, expected)
    except Exception as e:  # a torn, foreign or mismatched file: quantise again
        log.warning("discarding the quantised weights at %s (quantising again): %s", path, e)
        path.unlink(missing_ok=True)
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
