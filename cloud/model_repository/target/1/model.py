"""Triton Python backend shell over specsplit.cloud.engine.target: gather -> compute -> scatter.

Requests go to ``cloud.engine.batch.BatchEngine``, which serves all that are waiting with one
``TargetModel.run`` (one forward pass for every verification block and cloud-only step) and
answers each through its response sender.

Every failure is answered in the failing request's own response; the stub never dies for a bad
request.
"""

import json
import logging
import os
import sys

import numpy as np
import triton_python_backend_utils as pb_utils

from specsplit.cloud.engine.batch import BatchEngine
from specsplit.cloud.engine.target import (
    Close,
    KVCapacityExceeded,
    Open,
    PassInfo,
    Request,
    SessionNotFound,
    SessionParams,
    TargetModel,
    Verify,
)
from specsplit.cloud.kv_growth import KV_PER_CLIENT_SHARE
from specsplit.shared.acceptance import VerificationRule
from specsplit.shared.sampling import SamplingConfig, SparseDist

log = logging.getLogger("specsplit.target")


def _log_to_stderr() -> None:
    """The stub's stderr is tritonserver's log: without a handler, the target's INFO lines
    (the weights and precision chosen by calibration, its table, the forward cost by rows)
    were dropped."""
    root = logging.getLogger("specsplit")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)


def _param(config: dict, key: str, default: str = "") -> str:
    return config.get("parameters", {}).get(key, {}).get("string_value", default) or default


def _scalar(request, name: str, default=None):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return default if t is None else t.as_numpy().reshape(-1)[0].item()


def _array(request, name: str):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy()


def _response(
    accepted: int,
    token: int,
    verify_ms: float,
    cache_len: int,
    sessions: int,
    info,
    kv: tuple[int, int, int] = (0, 0, 0),  # START: bytes a position, capacity, held
):
    def out(name, value, dtype):
        return pb_utils.Tensor(name, np.array([[value]], dtype=dtype))

    return pb_utils.InferenceResponse(
        output_tensors=[
            out("ACCEPTED", accepted, np.int32),
            out("TOKEN", token, np.int64),
            out("VERIFY_MS", verify_ms, np.float32),
            out("CACHE_LEN", cache_len, np.int64),
            out("SESSIONS", sessions, np.int64),
            out("BATCH_ROWS", info.rows, np.int32),
            out("BATCH_SESSIONS", info.sessions, np.int32),
            out("MAX_DRAFT_TOKENS_HINT", info.max_draft_tokens_hint, np.int32),
            out("KV_BYTES", kv[0], np.int64),
            out("KV_CAPACITY", kv[1], np.int64),
            out("KV_HELD", kv[2], np.int64),
        ]
    )


def _send(sender, response) -> None:
    sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


def _error(e: Exception):
    if isinstance(e, SessionNotFound):
        return pb_utils.InferenceResponse(
            error=pb_utils.TritonError(f"SESSION_NOT_FOUND: {e.args[0]}")
        )
    if isinstance(e, KVCapacityExceeded):  # the gateway retries it (RESOURCE_EXHAUSTED)
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(f"KV_CAPACITY_EXCEEDED: {e}"))
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{type(e).__name__}: {e}"))


def _sparse_q(request) -> list | None:
    ids, probs = _array(request, "Q_IDS"), _array(request, "Q_PROBS")
    if ids is None:
        return None
    ids, probs = ids.reshape(ids.shape[-2:]), probs.reshape(probs.shape[-2:])  # [k, m]
    # Q_PROBS holds probabilities or quantised counts: normalising in float64 serves both.
    out = []
    for i, p in zip(ids, probs, strict=True):
        kept = p[i >= 0].astype(np.float64)
        out.append(SparseDist(i[i >= 0], kept / kept.sum()))
    return out


def _parse(request) -> Request:
    sid = int(_scalar(request, "CORRID"))
    tokens = _array(request, "TOKENS").reshape(-1).tolist()
    if _scalar(request, "START", 0):
        sampling = SamplingConfig(
            temperature=float(_scalar(request, "TEMPERATURE", 0.0)),
            top_k=int(_scalar(request, "TOP_K", 0)),
            top_p=float(_scalar(request, "TOP_P", 1.0)),
        )
        params = SessionParams(
            sampling,
            VerificationRule(int(_scalar(request, "VERIFICATION", int(VerificationRule.GREEDY)))),
            seed=int(_scalar(request, "SEED", 0)),
            speculative=bool(_scalar(request, "SPECULATIVE", 1)),
        )
        client, lease_s = int(_scalar(request, "CLIENT", 0)), float(_scalar(request, "LEASE_S", 0))
        return Open(sid, tokens, params, client=client, lease_s=lease_s)
    end = bool(_scalar(request, "END", 0))
    if end and not tokens:
        return Close(sid)
    base_len = int(_scalar(request, "BASE_LEN", -1))
    return Verify(sid, base_len, tokens, _sparse_q(request), end=end)


class TritonPythonModel:
    def initialize(self, args):
        _log_to_stderr()
        config = json.loads(args["model_config"])
        target_dir = os.environ.get("SPECSPLIT_TARGET_DIR") or _param(config, "target_dir")
        if not target_dir or not os.path.isfile(os.path.join(target_dir, "config.json")):
            raise pb_utils.TritonModelException(
                f"target_dir {target_dir!r} is not a Hugging Face model directory "
                "(set SPECSPLIT_TARGET_DIR or the target_dir parameter)"
            )
        threads = _param(config, "threads") or os.environ.get("SPECSPLIT_TARGET_THREADS", "")
        self.idle_s = float(_param(config, "session_idle_s", "600"))
        dtype = os.environ.get("SPECSPLIT_TARGET_DTYPE") or _param(config, "dtype", "auto")
        weights = os.environ.get("SPECSPLIT_TARGET_WEIGHTS") or _param(config, "weights", "auto")
        capacity_mib = os.environ.get("SPECSPLIT_KV_CAPACITY_MIB") or _param(
            config, "kv_capacity_mib"
        )
        # The share of the capacity one client's sessions may hold, whichever gateways opened
        # them (KVLedger.client_kv_quota); 0: no quota.
        per_client = os.environ.get("SPECSPLIT_KV_PER_CLIENT_SHARE") or _param(
            config, "kv_per_client_share", str(KV_PER_CLIENT_SHARE)
        )
        try:
            share = float(per_client)
        except ValueError:
            raise pb_utils.TritonModelException(
                f"the per-client KV share {per_client!r} is not a number in [0, 1] (0: off; "
                "SPECSPLIT_KV_PER_CLIENT_SHARE or the kv_per_client_share parameter)"
            ) from None
        try:
            self.target = TargetModel(
                target_dir,
                threads=int(threads) if threads else None,
                dtype=dtype,
                weights=weights,
                packed_linear=os.environ.get("SPECSPLIT_PACKED_LINEAR", "1") != "0",
                kv_capacity=int(float(capacity_mib) * 2**20) if capacity_mib else None,
                kv_per_client_share=share,
            )
        except ValueError as e:
            raise pb_utils.TritonModelException(str(e)) from e
        self.engine = BatchEngine(self.target, idle_s=self.idle_s)

    def execute(self, requests):
        # gather -> the engine thread batches across execute() calls -> each request's response
        # sender answers it (cloud.engine.batch explains why Triton's own batches are not enough)
        items = []
        for request in requests:
            sender = request.get_response_sender()
            try:
                parsed = _parse(request)
            except Exception as e:  # one bad request never takes the model down
                log.warning("bad request: %s", e)
                _send(sender, _error(e))
                continue
            items.append((parsed, self._responder(parsed, sender)))
        self.engine.submit(items)
        return None

    def _responder(self, request, sender):
        def respond(outcome, info):
            sessions = len(self.target.sessions)
            if isinstance(outcome, Exception):
                _send(sender, _error(outcome))
            elif isinstance(request, Open):
                cache_len = len(request.prompt) - 1
                # The gateway's admission counts KV bytes at the slots' real dtype, against
                # what this target may hold and holds now (all gateways' sessions).
                ledger = self.target.kv_ledger
                kv = (ledger.slots.bytes_per_token, ledger.kv_capacity, ledger.kv_bytes)
                _send(sender, _response(0, -1, info.ms, cache_len, sessions, info, kv))
            elif isinstance(request, Close):
                _send(sender, _response(0, -1, 0.0, 0, sessions, info or PassInfo()))
            else:
                r = outcome.result
                cache_len = request.base_len + r.accepted
                _send(
                    sender,
                    _response(r.accepted, r.token, outcome.verify_ms, cache_len, sessions, info),
                )

        return respond

    def finalize(self):
        self.engine.stop()
        self.target.sessions.clear()
