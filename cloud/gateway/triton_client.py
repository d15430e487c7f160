"""One generation's sequence on Triton, over one tritonclient.grpc.aio stream.

Requests carry the sequence id, so Triton routes them to the instance holding the session's KV
cache. Responses on a stream come back in request order, so a call is: put, then read one.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient

from specsplit.shared.acceptance import VerificationRule
from specsplit.shared.sampling import SamplingConfig, SparseDist

MODEL_NAME = "target"
_OUTPUTS = (
    "ACCEPTED",
    "TOKEN",
    "VERIFY_MS",
    "CACHE_LEN",
    "BATCH_ROWS",
    "BATCH_SESSIONS",
    "MAX_DRAFT_TOKENS_HINT",
)
# Random base: a restarted gateway never reuses a live sequence id.
_sequence_ids = itertools.count(secrets.randbits(62) + 1)


class TritonUnavailable(RuntimeError):
    """The inference server cannot be reached."""


class SessionLost(RuntimeError):
    """Triton no longer holds the session (restart, eviction): re-open with the committed prefix."""


class TritonRequestError(RuntimeError):
    """Triton refused a request (a bug on our side if the gateway validated it)."""


class TargetFull(TritonRequestError):
    """The target cannot hold the session's KV now (its capacity, or an out-of-memory pass):
    the session is as it was, the stream intact; the edge may retry when told."""


@dataclass(frozen=True)
class StepReply:
    accepted: int
    token: int
    verify_ms: float  # the model's forward pass + acceptance
    roundtrip_ms: float  # gateway -> Triton -> gateway
    batch_rows: int = 0  # rows of the forward pass that served it (all sessions together)
    batch_sessions: int = 0  # sessions in that pass
    max_draft_tokens_hint: int = 0  # the largest draft block the cloud wants now


def _tensor(name: str, array: np.ndarray, dtype: str) -> grpcclient.InferInput:
    t = grpcclient.InferInput(name, list(array.shape), dtype)
    t.set_data_from_numpy(array)
    return t


def _q_tensors(q: Sequence[SparseDist]) -> list[grpcclient.InferInput]:
    m = max(len(d.ids) for d in q)
    ids = np.full((1, len(q), m), -1, dtype=np.int64)  # [1, k, m], -1 pads
    probs = np.zeros((1, len(q), m), dtype=np.float32)
    for i, d in enumerate(q):
        ids[0, i, : len(d.ids)] = d.ids
        # Counts travel as exact integers; the model divides by their sum in float64, as the
        # edge did: the q it verifies against is bit for bit the one the draft sampled from.
        probs[0, i, : len(d.ids)] = d.probs if d.counts is None else d.counts
    return [_tensor("Q_IDS", ids, "INT64"), _tensor("Q_PROBS", probs, "FP32")]


def _int(result, name: str) -> int:
    return int(result.as_numpy(name).reshape(-1)[0])


def _optional(result, name: str) -> int | None:
    value = result.as_numpy(name)
    return int(value.reshape(-1)[0]) if value is not None else None


_STUB_DEAD = "is not healthy"  # Triton's "Stub process '<instance>' is not healthy."


def _classify(error: Exception) -> Exception:
    msg = str(error)
    if "SESSION_NOT_FOUND" in msg or "must specify the START flag" in msg:
        return SessionLost(msg)
    if "KV_CAPACITY_EXCEEDED" in msg:
        return TargetFull(msg)
    # A dead Python backend stub fails every request until its server is restarted (the
    # supervisor does that): the replica is down, like one that cannot be reached.
    if "StatusCode.UNAVAILABLE" in msg or "failed to connect" in msg.lower() or _STUB_DEAD in msg:
        return TritonUnavailable(msg)
    return TritonRequestError(msg)


class TritonSequence:
    def __init__(self, client: aioclient.InferenceServerClient):
        self.client = client
        self.sequence_id = next(_sequence_ids)
        self._queue: asyncio.Queue[dict | None] = asyncio.Queue()
        self._responses = None
        self._open = False
        self.speculative = True
        # Whose share of the target's prefill rows per pass this prompt counts against (a hash
        # of the gateway's client; 0: none, the session alone). Set before start.
        self.client_share = 0
        # The target evicts the session once idle this long (0: its own idle limit): a lease
        # each request renews, so the sessions of a gateway that died do not hold KV for long.
        self.lease_s = 0.0
        self.kv_bytes_per_token: int | None = None  # the target's, from its START reply
        # From the START reply: the KV bytes the target may hold and holds (every gateway's
        # sessions); None where it did not say (an older model, a fake).
        self.kv_capacity: int | None = None
        self.kv_held: int | None = None

    async def _requests(self):
        while (item := await self._queue.get()) is not None:
            yield item

    async def _call(self, inputs: list, start: bool = False, end: bool = False):
        if self._responses is None:
            self._responses = self.client.stream_infer(self._requests())
        # A START asks for every output the model has: KV_BYTES where the model reports it, and
        # no error from a model repository older than that output.
        outputs = None if start else [grpcclient.InferRequestedOutput(n) for n in _OUTPUTS]
        self._queue.put_nowait(
            {
                "model_name": MODEL_NAME,
                "inputs": inputs,
                "outputs": outputs,
                "sequence_id": self.sequence_id,
                "sequence_start": start,
                "sequence_end": end,
            }
        )
        try:
            result, error = await self._responses.__anext__()
        except Exception as e:  # StopAsyncIteration, InferenceServerException, gRPC errors
            self._responses = None  # the stream is gone; the next call opens a new one
            raise TritonUnavailable(f"inference server stream failed: {e}") from e
        if error is not None:
            raise _classify(error)
        return result

    async def start(
        self,
        prompt: Sequence[int],
        sampling: SamplingConfig,
        verification: VerificationRule,
        seed: int,
        speculative: bool = True,
    ) -> None:
        inputs = [
            _tensor("TOKENS", np.asarray([prompt], dtype=np.int64), "INT64"),
            _tensor("TEMPERATURE", np.array([[sampling.temperature]], np.float32), "FP32"),
            _tensor("TOP_K", np.array([[sampling.top_k]], np.int32), "INT32"),
            _tensor("TOP_P", np.array([[sampling.top_p]], np.float32), "FP32"),
            _tensor("SEED", np.array([[seed]], np.uint64), "UINT64"),
            _tensor("VERIFICATION", np.array([[int(verification)]], np.int32), "INT32"),
            _tensor("SPECULATIVE", np.array([[int(speculative)]], np.int32), "INT32"),
        ]
        if self.client_share:
            inputs.append(_tensor("CLIENT", np.array([[self.client_share]], np.int64), "INT64"))
        if self.lease_s:
            inputs.append(_tensor("LEASE_S", np.array([[self.lease_s]], np.float32), "FP32"))
        self.speculative = speculative
        result = await self._call(inputs, start=True)
        self._open = True
        self.kv_bytes_per_token = _optional(result, "KV_BYTES")
        self.kv_capacity = _optional(result, "KV_CAPACITY")
        self.kv_held = _optional(result, "KV_HELD")

    async def step(
        self, base_len: int, tokens: Sequence[int], q: Sequence[SparseDist] | None = None
    ) -> StepReply:
        """tokens: the last committed token, then d_1..d_k."""
        inputs = [
            _tensor("TOKENS", np.asarray([tokens], dtype=np.int64), "INT64"),
            _tensor("BASE_LEN", np.array([[base_len]], dtype=np.int64), "INT64"),
        ]
        if q:
            inputs += _q_tensors(q)
        t0 = time.perf_counter()
        result = await self._call(inputs)
        return StepReply(
            accepted=_int(result, "ACCEPTED"),
            token=_int(result, "TOKEN"),
            verify_ms=float(result.as_numpy("VERIFY_MS").reshape(-1)[0]),
            roundtrip_ms=(time.perf_counter() - t0) * 1e3,
            batch_rows=_int(result, "BATCH_ROWS"),
            batch_sessions=_int(result, "BATCH_SESSIONS"),
            max_draft_tokens_hint=_int(result, "MAX_DRAFT_TOKENS_HINT"),
        )

    async def reopen(self, prompt: Sequence[int], sampling, verification, seed) -> None:
        """A fresh sequence holding ``prompt`` (the committed prefix) after SessionLost."""
        self.sequence_id = next(_sequence_ids)
        self._open = False
        await self.start(prompt, sampling, verification, seed, self.speculative)

    async def close(self) -> None:
        """Frees the session's KV cache in Triton and ends the stream. Never raises."""
        if self._open:
            self._open = False
            with contextlib.suppress(Exception):
                empty = np.zeros((1, 0), dtype=np.int64)
                await asyncio.wait_for(
                    self._call([_tensor("TOKENS", empty, "INT64")], end=True), timeout=5
                )
        self._queue.put_nowait(None)
        if self._responses is not None:
            with contextlib.suppress(Exception):
                self._responses.cancel()
            self._responses = None
