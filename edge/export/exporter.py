"""Exports a Hugging Face checkpoint to the edge's ONNX draft format (a build step).

Families: ``edge.export.families.FAMILIES`` (Llama, Mistral, Qwen2/2.5, Qwen3, Gemma 2, Gemma 3
text, Phi-3/3.5/4-mini); each is read from its ``config.json`` by
``edge.export.families.read_spec``.

``export_onnx(model_dir, out_dir, precision)`` reads ``config.json`` + ``*.safetensors`` (single or
sharded; f32, f16 or bf16; tied or untied embeddings) and writes ``out_dir`` containing:

- ``model.onnx`` + ``model.onnx.data``: the graph of ``edge.export.onnx_graph`` (I/O contract
  there),
  weights as external data;
- ``specsplit_draft.json``: what ``edge.onnx_drafter.OnnxDrafter`` needs (``METADATA_FORMAT``),
  including the tokenizer's fingerprint (``shared.tokenizer_fingerprint``) for the pairing check;
- copies of the tokenizer / generation / model config files present in ``model_dir``.

The output is built in a temporary sibling directory and renamed into place, so a failed export
never leaves a half-written ``out_dir``. Precisions: ``fp32``; ``int8`` (block-wise int8
weights in MatMulNBits for every Linear, a per-row int8 embedding) and ``int4`` (4-bit
MatMulNBits, asymmetric blocks, for every Linear but the LM head, which stays int8); the block
size (default ``onnx_quant.DEFAULT_BLOCK``) and the LM head's bits are ``QuantOptions``; see
``edge.export.onnx_graph``.
Reading weights needs numpy only; torch is not imported here.
"""

from __future__ import annotations

import json
import logging
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specsplit.edge.export import token_freq
from specsplit.edge.export.families import ModelSpec, check_architecture, read_spec
from specsplit.edge.export.onnx_graph import OPSET, build_model
from specsplit.edge.export.onnx_quant import DEFAULT_BLOCK
from specsplit.edge.models import DEFAULT_HEAD_VOCAB, GRAPH_FORMAT, PRECISIONS
from specsplit.shared.tokenizer_fingerprint import token_count, tokenizer_fingerprint

log = logging.getLogger(__name__)

METADATA_FORMAT = 1
METADATA_FILE = "specsplit_draft.json"
ONNX_FILE = "model.onnx"
HEAD_IDS_FILE = "lm_head_ids.npy"  # present when the LM head is split: its frequent rows
COPIED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "config.json",
)


@dataclass(frozen=True)
class QuantOptions:
    """How the quantised precisions store their Linears (``edge.export.onnx_graph``)."""

    block: int = DEFAULT_BLOCK  # inputs per weight scale, one of onnx_quant.BLOCK_SIZES
    head_bits: int = 8  # the LM head's bits (4 or 8)


_SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": np.uint16}


class SafetensorsWeights:
    """Lazy float32 view of a (possibly sharded) safetensors checkpoint, read with numpy only."""

    def __init__(self, model_dir: Path) -> None:
        index = model_dir / "model.safetensors.index.json"
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            paths = [model_dir / f for f in files]
        else:
            paths = sorted(model_dir.glob("*.safetensors"))
        if not paths:
            raise FileNotFoundError(f"no *.safetensors in {model_dir}")
        self._entries: dict[str, tuple[Path, str, list[int], int]] = {}  # path, dtype, shape, at
        for path in paths:
            with path.open("rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
            for name, info in header.items():
                if name != "__metadata__":
                    offset = 8 + size + info["data_offsets"][0]
                    self._entries[name] = (path, info["dtype"], info["shape"], offset)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __call__(self, name: str) -> np.ndarray:
        path, dtype, shape, offset = self._entries[name]
        if dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{name}: unsupported safetensors dtype {dtype}")
        count = int(np.prod(shape, dtype=np.int64))
        raw = np.fromfile(path, dtype=_SAFETENSORS_DTYPES[dtype], count=count, offset=offset)
        if dtype == "BF16":  # bf16 is the top half of an fp32
            raw = (raw.astype(np.uint32) << 16).view(np.float32)
        return raw.astype(np.float32, copy=False).reshape(shape)


def eos_token_ids(model_dir: Path, config: dict) -> list[int]:
    """EOS ids of generation_config.json then config.json, deduplicated, in that order."""
    found: list[int] = []
    sources = [config]
    gen = model_dir / "generation_config.json"
    if gen.exists():
        sources.insert(0, json.loads(gen.read_text()))
    for source in sources:
        value = source.get("eos_token_id")
        for token in [value] if isinstance(value, int) else value or []:
            if token not in found:
                found.append(int(token))
    return found


def head_rows(
    model_dir: Path,
    config: dict,
    spec: ModelSpec,
    head_vocab: int | None,
    table: Path | None = None,
) -> np.ndarray | None:
    """The token ids of a draft's frequent LM head rows where its head splits at ``head_vocab``
    (0: no split; None: ``DEFAULT_HEAD_VOCAB`` where the table ranks this tokenizer, else no
    split; edge.export.onnx_graph), rising: the ``head_vocab`` most frequent ids by
    ``edge.export.token_freq``'s table (``table``, default its ``TABLE``) where that table was
    computed with this tokenizer (the ids a corpus never showed follow, by id), else the
    ``head_vocab`` lowest ids (byte-level BPE vocabularies number in merge order, roughly by
    frequency); plus every special or added token and the EOS ids. The cost of an LM head is
    its rows (a 0.5B draft's 136 MB of 494 MB read per token at 151,936 rows): the draft reads
    the frequent rows every step and the others only once its sequence holds one of them
    (edge.onnx_drafter); until then it never proposes them, which keeps speculation exact (q = 0
    there). None where the rows kept are all."""
    if head_vocab == 0:
        return None
    tokenizer = model_dir / "tokenizer.json"
    ranked = token_freq.ranking(tokenizer, table or token_freq.TABLE)
    if head_vocab is None:  # ids ranked by number alone were not measured as the default
        if ranked is None:
            return None
        head_vocab = DEFAULT_HEAD_VOCAB
    if head_vocab >= spec.vocab_size:
        return None
    if ranked is None:
        log.warning("no token frequencies for %s's tokenizer: its LM head keeps the lowest ids",
                    model_dir.name)  # fmt: skip
        order = np.arange(spec.vocab_size)
    else:
        ranked = ranked[ranked < spec.vocab_size]
        order = np.concatenate([ranked, np.setdiff1d(np.arange(spec.vocab_size), ranked)])
    keep = set(order[:head_vocab].tolist()) | set(eos_token_ids(model_dir, config))
    if tokenizer.exists():
        added = json.loads(tokenizer.read_text()).get("added_tokens", [])
        keep |= {int(t["id"]) for t in added if int(t["id"]) < spec.vocab_size}
    if len(keep) >= spec.vocab_size:
        return None
    return np.array(sorted(keep), dtype=np.int64)


def _token_count(model_dir: Path) -> int | None:
    """Ids the checkpoint's tokenizer defines (shared.tokenizer_fingerprint.token_count)."""
    path = model_dir / "tokenizer.json"
    return token_count(path) if path.exists() else None


def _fingerprint(model_dir: Path) -> str | None:
    """shared.tokenizer_fingerprint of the checkpoint's tokenizer.json; None without one."""
    path = model_dir / "tokenizer.json"
    if not path.exists():
        log.warning(
            "%s has no tokenizer.json: the draft carries no tokenizer fingerprint", model_dir
        )
        return None
    try:
        return tokenizer_fingerprint(path)
    except Exception as e:  # the edge tokenizes with the same package: it would fail there too
        raise ValueError(f"{path}: the tokenizers package cannot read it ({e})") from e


def _metadata(model_dir: Path, config: dict, spec: ModelSpec, precision: str) -> dict:
    return {
        "format": METADATA_FORMAT,
        "graph_format": GRAPH_FORMAT,
        "opset": OPSET,
        "onnx_file": ONNX_FILE,
        "architecture": spec.family,
        "precision": precision,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "num_layers": spec.num_layers,
        "num_heads": spec.num_heads,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "max_positions": spec.max_positions,
        "tied_embeddings": spec.tied_embeddings,
        "eos_token_ids": eos_token_ids(model_dir, config),
        "tokenizer_fingerprint": _fingerprint(model_dir),
        "token_count": _token_count(model_dir),
        "source": {"name": model_dir.name, "dir": str(model_dir)},
    }


def _write(
    model_dir: Path,
    tmp: Path,
    precision: str,
    progress: bool,
    head_vocab: int | None,
    quant: QuantOptions,
) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    check_architecture(config)  # before looking for weights
    weights = SafetensorsWeights(model_dir)
    spec = read_spec(config, has_lm_head="lm_head.weight" in weights)
    level = logging.INFO if progress else logging.DEBUG

    def on_layer(done: int, total: int) -> None:
        log.log(level, "export %s: layer %d/%d", model_dir.name, done, total)

    meta = _metadata(model_dir, config, spec, precision)  # an unreadable tokenizer: refused
    rows = head_rows(model_dir, config, spec, head_vocab)
    build_model(
        spec, weights, tmp / ONNX_FILE, precision, on_layer, rows, quant.block, quant.head_bits
    )
    for name in COPIED_FILES:
        if (model_dir / name).exists():
            shutil.copy2(model_dir / name, tmp / name)
    meta["block_size"], meta["head_bits"] = quant.block, quant.head_bits
    if rows is not None:
        np.save(tmp / HEAD_IDS_FILE, rows)
        meta["lm_head_ids"] = HEAD_IDS_FILE
    (tmp / METADATA_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    # mkdtemp creates an owner-only directory; an exported model is meant to be shared.
    tmp.chmod(0o755)
    for path in tmp.iterdir():
        path.chmod(0o644)


def export_onnx(
    model_dir: Path,
    out_dir: Path,
    precision: str = "fp32",
    progress: bool = False,
    head_vocab: int | None = None,
    quant: QuantOptions | None = None,
) -> Path:
    """Exports ``model_dir`` (a Hugging Face checkpoint of a supported family) to ``out_dir``;
    returns ``out_dir``. Replaces an old one.
    ``head_vocab``: the LM head split after that many of the most frequent ids (``head_rows``),
    the rest computed only where the sequence needs them; 0: one head over every id; None:
    ``edge.models.DEFAULT_HEAD_VOCAB`` where the shipped frequency table ranks this tokenizer's
    ids, else 0 (ids ranked by number alone were not measured as the default).
    ``quant``: MatMulNBits block size and LM head bits (``QuantOptions``; the defaults)."""
    if precision not in PRECISIONS:
        raise ValueError(f"unsupported precision {precision!r}; choose one of {PRECISIONS}")
    if head_vocab is not None and head_vocab < 0:
        raise ValueError(f"head_vocab must be >= 0 (0: the whole vocabulary), not {head_vocab}")
    model_dir, out_dir = Path(model_dir).resolve(), Path(out_dir).resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        _write(model_dir, tmp, precision, progress, head_vocab, quant or QuantOptions())
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            out_dir.rename(old / "replaced")
            tmp.rename(out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.log(logging.INFO if progress else logging.DEBUG, "exported %s to %s", model_dir, out_dir)
    return out_dir
