"""The target model's side of a round: prefill, verify a block in one forward pass, crop the cache.

Plain Python + torch, so it is unit-testable without Triton; ``model_repository/target/1/model.py``
is a thin shell over this. Knows nothing of gRPC or of stop conditions (the gateway owns those).

Cache invariant: after every call, a session's KV cache holds exactly ``committed[:-1]``, i.e.
``cache_len == committed_len - 1``. A verify request therefore feeds the last committed token
followed by the k drafts: k + 1 positions whose logits are p_1..p_{k+1}.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from specsplit.shared.acceptance import (
    Mode,
    RoundResult,
    verify_greedy,
    verify_rejection,
    verify_token_only,
)
from specsplit.shared.sampling import SamplingConfig, SparseDist, logits_to_probs
from specsplit.shared.seeding import round_rng

log = logging.getLogger(__name__)


class SessionNotFound(KeyError):
    """The session is unknown here (never started, ended, evicted, or the server restarted)."""


@dataclass(frozen=True)
class SessionParams:
    sampling: SamplingConfig
    mode: Mode
    seed: int = 0


@dataclass
class _Session:
    params: SessionParams
    cache: object  # transformers Cache
    cache_len: int
    last_used: float = field(default_factory=time.monotonic)


def _crop(session: _Session, length: int) -> None:
    # transformers 5: Cache.crop takes the (negative) number of positions to drop.
    if session.cache_len > length:
        session.cache.crop(length - session.cache_len)
        session.cache_len = length


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: float32 on CPU, bfloat16 on GPU.

    float32 on CPU keeps batched verification and one-token decoding numerically equal to
    well below any argmax margin seen in practice; bfloat16 is 2-3x faster on CPUs with bf16
    instructions, at the price of rare near-tie flips between block and single-token passes.
    """
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {name!r}") from None


def pick_device(requested: str | None = None) -> torch.device:
    if requested:
        return torch.device(requested)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class TargetModel:
    """A causal LM with one KV cache per session id."""

    def __init__(
        self,
        model_dir: str | Path,
        device: str | None = None,
        threads: int | None = None,
        dtype: str = "auto",
        packed_linear: bool = True,
    ):
        from transformers import AutoConfig, AutoModelForCausalLM

        if threads:
            torch.set_num_threads(threads)
        self.device = pick_device(device)
        dtype = resolve_dtype(dtype, self.device)
        self.config = AutoConfig.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(self.device)
        self.model.eval()
        if self.device.type == "cpu" and dtype == torch.float32 and packed_linear:
            from specsplit.cloud.packed_linear import pack_linears

            log.info("packed %d linear layers for oneDNN", pack_linears(self.model))
        self.vocab_size = int(self.config.vocab_size)
        self.sessions: dict[int, _Session] = {}
        self.forward_passes = 0
        log.info("target %s on %s (%s), vocab %d", model_dir, self.device, dtype, self.vocab_size)

    def _forward(self, session: _Session, tokens: Sequence[int]) -> torch.Tensor:
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            out = self.model(input_ids=ids, past_key_values=session.cache, use_cache=True)
        session.cache = out.past_key_values
        session.cache_len += len(tokens)
        self.forward_passes += 1
        return out.logits[0]  # [len(tokens), V]

    def start(self, sid: int, prompt: Sequence[int], params: SessionParams) -> None:
        """Opens (or re-opens) a session and prefills ``prompt[:-1]``."""
        from transformers import DynamicCache

        if not prompt:
            raise ValueError("prompt must hold at least one token")
        self._check_ids(prompt)
        session = _Session(params=params, cache=DynamicCache(), cache_len=0)
        if len(prompt) > 1:
            self._forward(session, prompt[:-1])
        self.sessions[sid] = session

    def verify(
        self,
        sid: int,
        base_len: int,
        tokens: Sequence[int],  # [k + 1]: last committed token, then d_1..d_k
        q: Sequence[SparseDist] | None = None,  # [k] for REJECTION
    ) -> RoundResult:
        session = self._get(sid)
        if base_len != session.cache_len + 1:
            raise ValueError(f"base_len {base_len} != committed_len {session.cache_len + 1}")
        if not tokens:
            raise ValueError("tokens must hold the last committed token")
        self._check_ids(tokens)
        drafts = list(tokens[1:])
        if session.params.mode is Mode.REJECTION and len(q or ()) != len(drafts):
            raise ValueError(f"rejection mode needs q for each of the {len(drafts)} drafts")
        try:
            logits = self._forward(session, tokens)  # [k + 1, V]
            result = self._accept(session.params, base_len, logits, drafts, q)
        except BaseException:
            _crop(session, base_len - 1)  # a failed round leaves the session as it was
            raise
        # Keep committed[:-1]: the old cache, the last committed token and the accepted drafts.
        _crop(session, base_len + result.accepted)
        session.last_used = time.monotonic()
        return result

    def _accept(self, params, base_len, logits, drafts, q) -> RoundResult:
        if params.mode is Mode.GREEDY:
            return verify_greedy(logits.argmax(dim=-1).cpu().numpy(), drafts)
        p = logits_to_probs(logits.float().cpu().numpy(), params.sampling)  # [k + 1, V]
        rng = round_rng(params.seed, "verify", base_len)
        if params.mode is Mode.REJECTION:
            return verify_rejection(p, drafts, q or [], rng)
        return verify_token_only(p, drafts, rng)

    def end(self, sid: int) -> bool:
        return self.sessions.pop(sid, None) is not None

    def evict_idle(self, max_idle_s: float) -> list[int]:
        now = time.monotonic()
        stale = [sid for sid, s in self.sessions.items() if now - s.last_used > max_idle_s]
        for sid in stale:
            del self.sessions[sid]
        return stale

    def _get(self, sid: int) -> _Session:
        try:
            return self.sessions[sid]
        except KeyError:
            raise SessionNotFound(f"unknown session {sid}") from None

    def _check_ids(self, tokens: Sequence[int]) -> None:
        arr = np.asarray(tokens)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise ValueError(f"token id outside the vocabulary [0, {self.vocab_size})")
