"""A target's weights read from the GGUF file it came from, at the file's own widths.

A model directory converted from a GGUF by ``shared.weights.sources`` (its completion marker names
the source) or holding exactly one ``*.gguf`` (``shared.weights.local_gguf`` links a GGUF given by
path there) has a GGUF source. Its projections, LM head and
token embedding are then served from the file's own quantised blocks (``cloud.engine.formats``:
Q4_K, Q6_K, Q8_0, ... each at its width) instead of being quantised again from the float copy:
the values are the file's exactly, and a pass reads about the bytes llama.cpp reads.

Each tensor is found through gguf's own name map for the architecture, and checked against the
float copy the model loaded (sampled rows, dequantised, equal to the copy within its bfloat16
rounding) before it is used: a tensor the check refuses (another row order, a format the kernels
do not read, a float tensor) is served from the float copy as before, and the log says so.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specsplit.cloud.engine import formats

log = logging.getLogger(__name__)

CHECK_ROWS = 8  # rows of each tensor compared with the float copy
# The float copy is the file's values rounded to bfloat16 (8 significant bits) or wider.
CHECK_RTOL = 2.0**-7


def source_gguf(model_dir: str | Path) -> Path | None:
    """The GGUF file ``model_dir`` was made from, if this machine has it."""
    from specsplit.shared.weights import sources

    model_dir = Path(model_dir)
    try:
        facts = json.loads((model_dir / sources.COMPLETE_MARKER).read_text())
    except (OSError, ValueError):
        facts = {}
    source = sources.SOURCES.get(facts.get("source", ""))
    if source is not None and facts.get("gguf_sha256") == source.sha256:
        path = sources.cached_gguf(source)
        if path is not None:
            return path
    found = sorted(p for p in model_dir.glob("*.gguf") if p.is_file())  # not a broken link
    return found[0] if len(found) == 1 else None


def _llama_rows(n: int, heads: int) -> np.ndarray:
    """HF row -> GGUF row for llama.cpp's q/k permutation (its converter interleaves each
    head's rotary halves): raw_hf = raw_gguf[_llama_rows(...)]."""
    perm = np.arange(n).reshape(heads, 2, n // heads // 2).swapaxes(1, 2).reshape(n)
    return np.argsort(perm)


@dataclass
class Tensor:
    """One GGUF tensor in a served format: its raw blocks [rows, bytes per row] (a memmap)."""

    name: str
    format: str
    raw: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)

    def rows(self, index) -> tuple[torch.Tensor, ...]:
        return formats.from_gguf(self.format, np.ascontiguousarray(self.raw[index]))


class GgufWeights:
    """The served tensors of one GGUF file, looked up by Hugging Face parameter name."""

    def __init__(self, path: str | Path, config):
        import gguf

        self.path = Path(path)
        self.reader = gguf.GGUFReader(self.path)
        field = self.reader.fields["general.architecture"]
        arch_name = bytes(field.parts[-1]).decode()
        arch = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}.get(arch_name)
        if arch is None:
            raise ValueError(f"{self.path}: unknown architecture {arch_name!r}")
        self.arch = arch_name
        self.names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.config = config
        self.served = set(formats.gguf_formats())
        self.refused: list[str] = []  # why tensors came from the float copy instead

    @property
    def file_bytes(self) -> int:
        """The bytes of the file's tensors that a pass reads (all but the token embedding)."""
        return sum(
            int(t.n_bytes) for n, t in self.tensors.items() if not n.startswith("token_embd")
        )

    def tensor(self, hf_name: str) -> Tensor | None:
        """The GGUF tensor of HF parameter ``hf_name`` (without ``.weight``), if served."""
        name = self.names.get_name(hf_name)
        t = self.tensors.get(f"{name}.weight") if name else None
        if t is None:
            return None
        fmt = t.tensor_type.name.lower()
        if fmt not in self.served:
            self.refused.append(f"{t.name}: {t.tensor_type.name} is not a kernel format")
            return None
        return Tensor(t.name, fmt, t.data)

    def weight(self, hf_name: str, copy: torch.Tensor) -> tuple[str, tuple] | None:
        """(format, natural tensors) of HF weight ``hf_name``, whose float copy is ``copy``
        [N, K], or None where the file does not hold it in a served format that matches."""
        t = self.tensor(hf_name)
        if t is None:
            return None
        if t.raw.shape[0] != copy.shape[0]:
            self.refused.append(f"{t.name}: {t.raw.shape[0]} rows, the model has {copy.shape[0]}")
            return None
        if not self.matches(t, copy, None):
            heads = self._heads(hf_name)
            order = None if heads is None else _llama_rows(copy.shape[0], heads)
            if order is None or not self.matches(t, copy, order):
                self.refused.append(f"{t.name}: its values differ from the model's")
                return None
            t = Tensor(t.name, t.format, t.raw[order])
        return t.format, t.rows(slice(None))

    def _heads(self, hf_name: str) -> int | None:
        """Heads of a q or k projection (the ones llama.cpp's converter may permute)."""
        if hf_name.endswith("q_proj"):
            return self.config.num_attention_heads
        if hf_name.endswith("k_proj"):
            return self.config.num_key_value_heads
        return None

    def matches(self, t: Tensor, copy: torch.Tensor, order: np.ndarray | None) -> bool:
        n = copy.shape[0]
        rows = np.unique(np.linspace(0, n - 1, min(CHECK_ROWS, n)).astype(np.int64))
        raw_rows = rows if order is None else order[rows]
        got = formats.dequantize(t.format, t.rows(raw_rows))
        want = copy[torch.from_numpy(rows)].float()
        if got.shape != want.shape:
            return False
        return bool(torch.allclose(got, want, rtol=CHECK_RTOL, atol=1e-30))


class Embedding:
    """Token embedding rows dequantised from the file's blocks on lookup (float32), so the
    process never holds the whole table in float. The blocks are copied out of the file's
    mapping, which is then let go (its pages read at load would count in memory otherwise)."""

    def __init__(self, tensor: Tensor):
        self.tensor = Tensor(tensor.name, tensor.format, np.array(tensor.raw))

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        index = ids.numpy().astype(np.int64)
        return formats.dequantize(self.tensor.format, self.tensor.rows(index))


def mlp_formats(path: str | Path, config) -> tuple[str, str] | None:
    """(gate/up format, down format) of the file's first layer, if the kernels serve both."""
    weights = GgufWeights(path, config)
    up = weights.tensor("model.layers.0.mlp.up_proj")
    down = weights.tensor("model.layers.0.mlp.down_proj")
    return None if up is None or down is None else (up.format, down.format)


def synthetic(fmt: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Natural-layout weights of ``fmt`` [n, k] from random blocks with small float16 scales
    (a calibration's stand-in for a real tensor: the kernels' cost does not depend on values)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[fmt.upper()]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(1e-3).tobytes(), dtype=np.uint8)
    if fmt == "q6_k":  # ql, qh, scales, then d last
        raw[..., size - 2 : size] = scale
    else:  # d first (and the K-quants' dmin next)
        raw[..., 0:2] = scale
        if fmt in ("q4_k", "q5_k"):
            raw[..., 2:4] = scale
    return formats.from_gguf(fmt, raw.reshape(n, -1))
