"""Triton Python backend shell over specsplit.cloud.target: gather -> compute -> scatter.

Every failure is answered in the failing request's own response; the stub never dies for a bad
request.
"""

import json
import logging
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils

from specsplit.cloud.target import SessionNotFound, SessionParams, TargetModel
from specsplit.shared.acceptance import Mode
from specsplit.shared.sampling import SamplingConfig, SparseDist

log = logging.getLogger("specsplit.target")


def _param(config: dict, key: str, default: str = "") -> str:
    return config.get("parameters", {}).get(key, {}).get("string_value", default) or default


def _scalar(request, name: str, default=None):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return default if t is None else t.as_numpy().reshape(-1)[0].item()


def _array(request, name: str):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy()


def _response(accepted: int, token: int, verify_ms: float, cache_len: int, sessions: int):
    return pb_utils.InferenceResponse(
        output_tensors=[
            pb_utils.Tensor("ACCEPTED", np.array([[accepted]], dtype=np.int32)),
            pb_utils.Tensor("TOKEN", np.array([[token]], dtype=np.int64)),
            pb_utils.Tensor("VERIFY_MS", np.array([[verify_ms]], dtype=np.float32)),
            pb_utils.Tensor("CACHE_LEN", np.array([[cache_len]], dtype=np.int64)),
            pb_utils.Tensor("SESSIONS", np.array([[sessions]], dtype=np.int64)),
        ]
    )


def _sparse_q(request) -> list | None:
    ids, probs = _array(request, "Q_IDS"), _array(request, "Q_PROBS")
    if ids is None:
        return None
    ids, probs = ids.reshape(ids.shape[-2:]), probs.reshape(probs.shape[-2:])  # [k, m]
    return [
        SparseDist(i[i >= 0], p[i >= 0].astype(np.float64)) for i, p in zip(ids, probs, strict=True)
    ]


class TritonPythonModel:
    def initialize(self, args):
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
        try:
            self.target = TargetModel(
                target_dir,
                threads=int(threads) if threads else None,
                dtype=dtype,
                packed_linear=os.environ.get("SPECSPLIT_PACKED_LINEAR", "1") != "0",
            )
        except ValueError as e:
            raise pb_utils.TritonModelException(str(e)) from e

    def execute(self, requests):
        self.target.evict_idle(self.idle_s)
        responses = []
        for request in requests:
            try:
                responses.append(self._one(request))
            except SessionNotFound as e:
                responses.append(
                    pb_utils.InferenceResponse(
                        error=pb_utils.TritonError(f"SESSION_NOT_FOUND: {e.args[0]}")
                    )
                )
            except Exception as e:  # one bad request never takes the model down
                log.warning("request failed: %s", e)
                responses.append(
                    pb_utils.InferenceResponse(
                        error=pb_utils.TritonError(f"{type(e).__name__}: {e}")
                    )
                )
        return responses

    def _one(self, request):
        sid = int(_scalar(request, "CORRID"))
        tokens = _array(request, "TOKENS").reshape(-1).tolist()
        if _scalar(request, "START", 0):
            t0 = time.perf_counter()
            sampling = SamplingConfig(
                temperature=float(_scalar(request, "TEMPERATURE", 0.0)),
                top_k=int(_scalar(request, "TOP_K", 0)),
                top_p=float(_scalar(request, "TOP_P", 1.0)),
            )
            mode = Mode(int(_scalar(request, "MODE", int(Mode.GREEDY))))
            params = SessionParams(sampling, mode, seed=int(_scalar(request, "SEED", 0)))
            self.target.start(sid, tokens, params)
            ms = (time.perf_counter() - t0) * 1e3
            return _response(0, -1, ms, len(tokens) - 1, len(self.target.sessions))
        if _scalar(request, "END", 0) and not tokens:
            self.target.end(sid)
            return _response(0, -1, 0.0, 0, len(self.target.sessions))
        t0 = time.perf_counter()
        base_len = int(_scalar(request, "BASE_LEN", -1))
        result = self.target.verify(sid, base_len, tokens, _sparse_q(request))
        ms = (time.perf_counter() - t0) * 1e3
        if _scalar(request, "END", 0):
            self.target.end(sid)
        sessions = len(self.target.sessions)
        return _response(result.accepted, result.token, ms, base_len + result.accepted, sessions)

    def finalize(self):
        self.target.sessions.clear()
