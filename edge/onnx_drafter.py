"""The edge's draft model: ONNX Runtime over an ``edge.export`` directory, plus its KV cache.

Contract: ``OnnxDrafter`` knows token ids, logits and the cache; nothing about tokenization,
sampling or the protocol. ``cached`` is the token prefix whose keys/values are in the cache.
``forward(tokens)`` runs one pass over ``tokens`` appended after ``cached`` and returns their
logits; ``truncate(n)`` rolls the cache back to ``cached[:n]`` without recomputing anything (the
cache is sliced along its sequence axis), and is exact: ``truncate(n)`` then ``forward(x)``
gives the logits of a fresh run over ``cached[:n] + x``.

Edge runtime only: onnxruntime + numpy. Never import torch or transformers here.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

log = logging.getLogger(__name__)

METADATA_FILE = "specsplit_draft.json"  # same name as edge.export writes (not imported: no torch)
SUPPORTED_FORMAT = 1


def default_providers() -> list[str]:
    """CUDA when this onnxruntime build has it (ORT falls back to CPU if it cannot start)."""
    if "CUDAExecutionProvider" in ort.get_available_providers():
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def _create_session(path: str, options, providers: list[str]) -> ort.InferenceSession:
    # onnxruntime-gpu lists CUDA even where its libraries are missing, and then logs an ERROR
    # before falling back to CPU. A fallback is expected on CPU-only machines: keep it quiet and
    # report the provider actually in use instead.
    if providers[0] != "CUDAExecutionProvider":
        return ort.InferenceSession(path, sess_options=options, providers=providers)
    ort.set_default_logger_severity(4)
    try:
        session = ort.InferenceSession(path, sess_options=options, providers=providers)
    finally:
        ort.set_default_logger_severity(2)
    if session.get_providers()[0] != "CUDAExecutionProvider":
        log.info("CUDA execution provider unavailable here; the draft runs on CPU")
    return session


class OnnxDrafter:
    """Incremental forward passes of the exported draft model with a rollback-able KV cache."""

    def __init__(
        self, model_dir: Path, providers: list[str] | None = None, threads: int | None = None
    ) -> None:
        model_dir = Path(model_dir)
        meta = json.loads((model_dir / METADATA_FILE).read_text())
        if meta.get("format") != SUPPORTED_FORMAT:
            raise ValueError(f"{model_dir}: draft format {meta.get('format')}, need 1")
        self.vocab_size: int = int(meta["vocab_size"])
        self.eos_token_ids: tuple[int, ...] = tuple(meta["eos_token_ids"])
        self.precision: str = meta["precision"]
        self.max_positions: int = int(meta["max_positions"])
        self._num_layers = int(meta["num_layers"])

        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.inter_op_num_threads = 1
        if threads is not None:
            options.intra_op_num_threads = threads
        self._session = _create_session(
            str(model_dir / meta["onnx_file"]), options, providers or default_providers()
        )
        self.provider: str = self._session.get_providers()[0]

        empty = np.zeros((1, int(meta["num_kv_heads"]), 0, int(meta["head_dim"])), np.float32)
        self._kv: list[np.ndarray] = [empty] * (2 * self._num_layers)  # [1, kv, >=len, hd] each
        layers = [(kind, i) for i in range(self._num_layers) for kind in ("key", "value")]
        self._input_names = [f"past_{kind}.{i}" for kind, i in layers]
        self._output_names = ["logits"] + [f"present_{kind}.{i}" for kind, i in layers]
        self._tokens: list[int] = []
        # An LM head over part of the vocabulary (edge.export.head_rows): the others' logits
        # are -inf, so the draft never proposes them (its q is 0 there, which keeps it exact).
        ids = meta.get("lm_head_ids")
        self._head_ids = None if ids is None else np.load(model_dir / ids)
        log.info("draft %s (%s) on %s", meta["source"]["name"], self.precision, self.provider)

    @property
    def cached(self) -> list[int]:
        """Tokens whose keys/values are in the cache (a copy; mutate via forward/truncate)."""
        return list(self._tokens)

    def forward(self, tokens: Sequence[int]) -> np.ndarray:
        """Appends ``tokens`` after ``cached``; returns their logits [len(tokens), vocab]."""
        past = len(self._tokens)
        seq = len(tokens)
        if seq == 0:
            raise ValueError("forward needs at least one token")
        if past + seq > self.max_positions:
            raise ValueError(f"context {past + seq} exceeds the model's {self.max_positions}")
        feeds = {
            "input_ids": np.asarray(tokens, dtype=np.int64).reshape(1, seq),  # [1, seq]
            "position_ids": np.arange(past, past + seq, dtype=np.int64).reshape(1, seq),
        }
        for name, kv in zip(self._input_names, self._kv, strict=True):
            # After a truncate the cache is a strided view; ORT needs contiguous memory.
            feeds[name] = kv if kv.shape[2] == past else np.ascontiguousarray(kv[:, :, :past])
        logits, *present = self._session.run(self._output_names, feeds)
        self._kv = present  # [1, kv, past+seq, hd] each
        self._tokens.extend(int(t) for t in tokens)
        if self._head_ids is None:
            return logits[0]  # [seq, vocab]
        full = np.full((seq, self.vocab_size), -np.inf, dtype=np.float32)
        full[:, self._head_ids] = logits[0]
        return full

    def truncate(self, n: int) -> None:
        """Rolls the cache back to ``cached[:n]`` (bookkeeping only; the slice happens lazily)."""
        if not 0 <= n <= len(self._tokens):
            raise ValueError(f"truncate({n}) outside 0..{len(self._tokens)}")
        del self._tokens[n:]

    def reset(self) -> None:
        self.truncate(0)
