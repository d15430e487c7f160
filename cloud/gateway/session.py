"""One generation's bookkeeping at the gateway: validation, committed prefix, stop conditions.

Pure Python (no gRPC, no Triton): the gateway turns ``ProtocolError`` into a status code. The
cloud is authoritative for stops: tokens emitted after an EOS, a stop id or the length limit are
discarded here, never reach the client, and are not counted as accepted.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from specsplit.cloud.kv_growth import MAX_DRAFT_TOKENS
from specsplit.shared.acceptance import VerificationRule
from specsplit.shared.sampling import SamplingConfig


class Code(enum.Enum):
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    NOT_FOUND = "NOT_FOUND"
    UNAVAILABLE = "UNAVAILABLE"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"


class ProtocolError(Exception):
    def __init__(self, code: Code, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class Finish(enum.IntEnum):
    """Values match the proto's FinishReason."""

    NONE = 0
    EOS = 1
    STOP_TOKEN = 2
    LENGTH = 3
    CANCELLED = 4


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    max_context: int
    max_draft_tokens: int = MAX_DRAFT_TOKENS
    max_q_entries: int = 64
    eos_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Commit:
    """What a round adds to the output after stop conditions."""

    accepted: int  # draft tokens kept
    token: int | None  # correction/bonus, None when a stop came first
    committed_len: int
    finish: Finish


def check_ids(tokens: Sequence[int], vocab_size: int, what: str) -> None:
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.size and arr.max() >= vocab_size:
        raise ProtocolError(
            Code.INVALID_ARGUMENT,
            f"{what}: token id {int(arr.max())} outside the vocabulary [0, {vocab_size})",
        )


@dataclass
class GatewaySession:
    limits: ModelLimits
    prompt: list[int]
    sampling: SamplingConfig
    verification: VerificationRule
    seed: int
    max_new_tokens: int
    stop_ids: frozenset[int] = frozenset()
    committed: list[int] = field(default_factory=list)
    finish: Finish = Finish.NONE
    rounds: int = 0
    drafts_dropped: int = 0  # cloud-led: Drafts never verified
    drafts_used: int = 0

    def __post_init__(self) -> None:
        self.committed = list(self.prompt)

    @property
    def committed_len(self) -> int:
        return len(self.committed)

    @property
    def new_tokens(self) -> int:
        return len(self.committed) - len(self.prompt)

    def check_draft(
        self,
        base_len: int,
        tokens: Sequence[int],
        n_q: int,
        exact_base: bool = True,
        continues: bool = False,
        branch: bool = False,
    ) -> None:
        """Validates a Draft against the session; raises ProtocolError. ``exact_base`` False
        (cloud-led): any base_len up to committed_len (an older Draft is stale, not wrong), and
        past it for a continuation of the previous Draft (``continues``), within the block
        limit of committed_len. A ``branch`` (Draft.branch) is cloud-led only, and whole."""
        if self.finish is not Finish.NONE:
            raise ProtocolError(Code.FAILED_PRECONDITION, "generation already finished")
        for flag, name in ((continues, "continues"), (branch, "branch")):
            if flag and exact_base:
                raise ProtocolError(
                    Code.INVALID_ARGUMENT, f"Draft.{name} is only valid in a cloud_led session"
                )
        if continues and branch:
            raise ProtocolError(
                Code.INVALID_ARGUMENT,
                "Draft.branch with Draft.continues: a branch is sent whole, from base_len",
            )
        reach = self.committed_len + self.limits.max_draft_tokens
        if continues and base_len + len(tokens) > reach:
            raise ProtocolError(
                Code.INVALID_ARGUMENT,
                f"continued draft reaches position {base_len + len(tokens)}, past committed_len "
                f"{self.committed_len} + max_draft_tokens {self.limits.max_draft_tokens}",
            )
        if exact_base and base_len != self.committed_len:
            raise ProtocolError(
                Code.FAILED_PRECONDITION,
                f"base_len {base_len} != committed_len {self.committed_len}",
            )
        if base_len > self.committed_len and not continues:
            raise ProtocolError(
                Code.FAILED_PRECONDITION,
                f"base_len {base_len} > committed_len {self.committed_len}",
            )
        if len(tokens) > self.limits.max_draft_tokens:
            raise ProtocolError(
                Code.INVALID_ARGUMENT,
                f"block of {len(tokens)} tokens exceeds max_draft_tokens "
                f"{self.limits.max_draft_tokens}",
            )
        check_ids(tokens, self.limits.vocab_size, "draft")
        if self.verification is VerificationRule.REJECTION and n_q != len(tokens):
            raise ProtocolError(
                Code.INVALID_ARGUMENT,
                f"the rejection rule needs q for every draft token ({n_q} for {len(tokens)})",
            )
        if self.verification is not VerificationRule.REJECTION and n_q:
            raise ProtocolError(
                Code.INVALID_ARGUMENT,
                f"q is only sent under the rejection rule (rule {self.verification.name})",
            )

    def commit(self, drafts: Sequence[int], accepted: int, token: int) -> Commit:
        """Appends d_1..d_accepted, token, stopping at the first stop condition."""
        emitted = list(drafts[:accepted]) + [token]
        kept = 0
        for t in emitted:
            self.committed.append(int(t))
            kept += 1
            self.finish = self._stop_reason(int(t))
            if self.finish is not Finish.NONE:
                break
        self.rounds += 1
        has_token = kept == len(emitted)
        return Commit(
            accepted=kept - 1 if has_token else kept,
            token=int(token) if has_token else None,
            committed_len=self.committed_len,
            finish=self.finish,
        )

    def _stop_reason(self, token: int) -> Finish:
        if token in self.limits.eos_token_ids:
            return Finish.EOS
        if token in self.stop_ids:
            return Finish.STOP_TOKEN
        if self.new_tokens >= self.max_new_tokens:
            return Finish.LENGTH
        return Finish.NONE
