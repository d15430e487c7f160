"""The draft as the edge runs it: an ONNX export, made once and cached, found here.

``find_draft_onnx`` takes an export directory (used as is), a local Hugging Face directory, or a
default model name, and returns its cached export where there is one. Making an export that is
missing is a build step (``edge.export.ensure.ensure_draft_onnx``, the ``export`` extra: onnx;
torch, transformers and gguf to convert weights); running one needs only the ``edge`` extra, and
nothing in this module imports the exporter. So an edge that pulled its draft ahead of time, or
was given an export directory, never needs the build-step packages.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from specsplit.shared.build_steps import cache_dir
from specsplit.shared.weights.sources import (
    DRAFT_DEFAULT,
    SOURCES,
    STORAGE_DTYPE,
    GgufChunkSource,
    hf_dir_path,
    resolve_model,
)

METADATA = "specsplit_draft.json"
DEFAULT_DRAFT = DRAFT_DEFAULT.name
PRECISIONS = (
    "fp32",
    "int8",
    "int4",
    "fp16",
    "int4-fp16",
)  # edge.export.exporter's weight formats (edge.export.onnx_graph); *fp16: for GPU providers
# The graph's I/O contract (edge.export.onnx_graph), checked by the drafter, and the export's
# layout, which names the cached export. 5: an LM head split by frequency (--head-vocab)
# computes the other ids on demand (rest_from, logits_rest) instead of never; 4: MatMulNBits
# blocks of 128 (edge.export.onnx_quant; the I/O of 3, so the drafter runs 3 too: only the cache
# exports again). 3: the LM head runs
# from input logits_from on (a prefill computes its last position's logits only); 2: the KV cache
# is one buffer per layer written in place (TensorScatter); 1 returned concat(past, new) each step.
GRAPH_FORMAT = 5
# int4 (blocks of 128): on one AMD EPYC core 19.4 ms/token of CPU vs int8's 22.9, agreement with
# the served target on code 0.898 vs 0.911, prose 0.732 vs 0.732 (README "Draft precision",
# bench.draft_agreement). int8 stays one flag away.
DEFAULT_PRECISION = "int4"
# The LM head split after this many of the most frequent ids where the shipped frequency table
# ranks the tokenizer (edge.export.exporter.export_onnx; the rest computed once the sequence
# holds one of them): one AMD EPYC core stepped in 16.8 ms against one head's 19.8 (19.7 while
# the text holds another id), at equal agreement, and the split ran 1.04-1.12x as fast with
# 5-12% less edge CPU per token (README "Draft precision", bench.draft_ab).
DEFAULT_HEAD_VOCAB = 65536


def export_dir(model: Path | GgufChunkSource, precision: str) -> Path:
    """Where the export of ``model`` at ``precision`` is cached (it may not be there yet).

    The name is keyed by what the model is, never by where it lies, so a cache copied to another
    path, user or mount still finds its exports: a default model by its source's identity (the
    published GGUF's sha256: known before anything is fetched), a local Hugging Face directory by
    its files' contents (``content_key``). The graph format is part of the name, so an export an
    older version made is exported again, never run by a drafter that reads another contract.
    """
    if isinstance(model, GgufChunkSource):
        # what its HF directory is converted from, and into (shared.weights.sources)
        identity = f"{model.name}\0{model.sha256}\0{STORAGE_DTYPE}"
        name, key = model.name, hashlib.sha256(identity.encode()).hexdigest()[:12]
    else:
        name, key = model.name, content_key(model)
    return cache_dir() / "onnx" / f"{name}-{key}-{precision}-g{GRAPH_FORMAT}"


def cached_tokenizer_dir(spec: str | Path = DEFAULT_DRAFT) -> Path | None:
    """A directory that already holds the draft's tokenizer (``tokenizer.json``), found without
    fetching, converting or exporting anything: ``spec`` itself (an export or a Hugging Face
    directory), or for a default name its export at any precision or its converted Hugging Face
    directory in the cache. None where there is none yet."""
    source = SOURCES.get(str(spec))
    if source is None:
        candidates = [Path(spec).expanduser()]
    else:
        candidates = [*(export_dir(source, p) for p in PRECISIONS), hf_dir_path(source)]
    return next((d for d in candidates if (d / "tokenizer.json").is_file()), None)


def _legacy_export_dir(hf_dir: Path, precision: str) -> Path:
    """The name exports had before they were keyed by content (a hash of the HF directory's
    absolute path): still found where it is, so an existing cache is not exported again."""
    key = hashlib.sha1(str(hf_dir.resolve()).encode()).hexdigest()[:8]
    return cache_dir() / "onnx" / f"{hf_dir.name}-{key}-{precision}-g{GRAPH_FORMAT}"


def content_key(hf_dir: Path) -> str:
    """A digest of a Hugging Face directory's files (names, sizes, bytes; hidden files left
    out). Hashing a draft's weights takes a second or so per GB, so the digest is remembered in
    ``<cache>/onnx/.content-keys.json`` against each file's path, size and mtime: a directory
    seen before is keyed without reading it again, a copied one is read once."""
    root = hf_dir.resolve()
    if not root.is_dir():
        raise FileNotFoundError(f"{hf_dir} is not a directory")
    memo_path = cache_dir() / "onnx" / ".content-keys.json"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    files = sorted(f for f in root.rglob("*") if f.is_file() and not f.name.startswith("."))
    stats = [(f, f.stat()) for f in files]
    stamp = [[str(f), st.st_size, st.st_mtime_ns] for f, st in stats]
    if memo.get(str(root), {}).get("stamp") == stamp:
        return memo[str(root)]["key"]
    digest = hashlib.sha256()
    for f, st in stats:
        digest.update(f"{f.relative_to(root).as_posix()}\0{st.st_size}\0".encode())
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 22):
                digest.update(chunk)
    key = digest.hexdigest()[:12]
    memo[str(root)] = {"stamp": stamp, "key": key}
    try:  # a memo that cannot be written only costs a re-hash next time
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo_path.with_name(f"{memo_path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(memo))
        os.replace(tmp, memo_path)
    except OSError:
        pass
    return key


def find_draft_onnx(spec: str | Path, precision: str) -> Path | None:
    """The ONNX draft dir of an export dir, a local HF dir or a default name, where it is
    already exported; None where it is not (``edge.export.ensure.ensure_draft_onnx`` makes it).
    """
    path = Path(spec).expanduser()
    if (path / METADATA).is_file():
        return path
    # A default name's export is found without converting (the HF dir may not exist); any other
    # spec must be a local HF dir (or resolve_model says clearly what is wrong).
    source = SOURCES.get(str(spec))
    hf_dir = hf_dir_path(source) if source else resolve_model(spec)
    for found in (export_dir(source or hf_dir, precision), _legacy_export_dir(hf_dir, precision)):
        if (found / METADATA).is_file():
            return found
    return None
