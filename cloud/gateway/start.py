"""Every check of a stream's first message, in one place: a Start becomes a session or a
precise status (docs/design.md#errors), before anything reaches Triton.
"""

from __future__ import annotations

import math
import secrets

from specsplit.cloud.gateway.identity import ModelIdentity
from specsplit.cloud.gateway.session import Code, GatewaySession, ProtocolError, check_ids
from specsplit.shared.acceptance import resolve_verification
from specsplit.shared.protocol import (
    PB_TO_VERIFICATION,
    PROTOCOL_VERSION,
    pb,
    session_mode_of,
)
from specsplit.shared.sampling import SamplingConfig
from specsplit.shared.session_mode import SessionMode

# Below this a float32 logit divided by the temperature can overflow to inf (NaN probabilities).
MIN_TEMPERATURE = 1e-4


def open_session(
    first: pb.ClientMessage, model: ModelIdentity
) -> tuple[GatewaySession, SessionMode]:
    """The session a stream's first message opens, and its mode; raises ProtocolError."""
    if first.WhichOneof("msg") != "start":
        raise ProtocolError(Code.FAILED_PRECONDITION, "the first message must be Start")
    start = first.start
    try:
        session_mode = session_mode_of(start)
    except ValueError as e:
        raise ProtocolError(Code.INVALID_ARGUMENT, str(e)) from None
    if start.protocol_version != PROTOCOL_VERSION:
        raise ProtocolError(
            Code.FAILED_PRECONDITION,
            f"unsupported protocol_version {start.protocol_version} (this server speaks 1)",
        )
    if start.model and start.model != model.name:
        raise ProtocolError(
            Code.NOT_FOUND, f"unknown model {start.model!r} (serving {model.name!r})"
        )
    known = start.draft_tokenizer and model.tokenizer_fingerprint
    if known and start.draft_tokenizer != model.tokenizer_fingerprint:
        raise ProtocolError(
            Code.FAILED_PRECONDITION,
            f"the draft's tokenizer ({start.draft_tokenizer[:19]}...) is not the target "
            f"{model.name!r}'s ({model.tokenizer_fingerprint[:19]}...): a draft must share "
            "its target's tokenizer",
        )
    limits = model.limits
    prompt = list(start.prompt_ids)
    if not prompt:
        raise ProtocolError(Code.INVALID_ARGUMENT, "prompt_ids must hold at least one token")
    check_ids(prompt, limits.vocab_size, "prompt_ids")
    check_ids(start.sampling.stop_token_ids, limits.vocab_size, "stop_token_ids")
    if len(prompt) >= limits.max_context:
        raise ProtocolError(
            Code.INVALID_ARGUMENT,
            f"prompt of {len(prompt)} tokens leaves no room in max_context {limits.max_context}",
        )
    if start.sampling.max_new_tokens < 1:
        raise ProtocolError(Code.INVALID_ARGUMENT, "max_new_tokens must be >= 1")
    requested = PB_TO_VERIFICATION.get(start.verification)
    if requested is None and start.verification != pb.VERIFICATION_RULE_UNSPECIFIED:
        raise ProtocolError(
            Code.INVALID_ARGUMENT, f"unknown verification rule {start.verification}"
        )
    sampling = sampling_config(start.sampling, limits.vocab_size)
    try:
        verification = resolve_verification(requested, sampling.temperature, has_q=True)
    except ValueError as e:
        raise ProtocolError(Code.INVALID_ARGUMENT, str(e)) from None
    session = GatewaySession(
        limits=limits,
        prompt=prompt,
        sampling=sampling,
        verification=verification,
        # Absent: a fresh random seed per request, returned in Started.
        seed=start.sampling.seed if start.sampling.HasField("seed") else secrets.randbits(63),
        max_new_tokens=min(start.sampling.max_new_tokens, limits.max_context - len(prompt)),
        stop_ids=frozenset(start.sampling.stop_token_ids),
    )
    return session, session_mode


def sampling_config(params: pb.SamplingParams, vocab_size: int) -> SamplingConfig:
    """The session's sampling rule, every field checked against its real range.

    top_p 0 is read as 1 (proto3 default). top_k >= vocab_size keeps every token, the same
    distribution as 0 (disabled), and is read as 0, so it never overflows Triton's int32.
    """
    t, top_p = params.temperature, params.top_p
    if not math.isfinite(t) or t < 0 or 0 < t < MIN_TEMPERATURE:
        raise ProtocolError(
            Code.INVALID_ARGUMENT,
            f"temperature must be 0 (greedy) or finite and >= {MIN_TEMPERATURE:g}, got {t}",
        )
    if not math.isfinite(top_p) or not 0 <= top_p <= 1:
        raise ProtocolError(Code.INVALID_ARGUMENT, f"top_p must be in [0, 1], got {top_p}")
    top_k = params.top_k if params.top_k < vocab_size else 0
    return SamplingConfig(temperature=t, top_k=top_k, top_p=top_p if top_p > 0 else 1.0)
