"""One verification step of a session, whatever its mode: a Draft checked and its q parsed,
its tokens verified by the target through the session's lease, the Verdict built.

The mode loops (``cloud.gateway.lockstep``, ``cloud.gateway.cloud_led``,
``cloud.gateway.cloud_only``) decide which tokens a step verifies and when; this owns how.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence

from specsplit.cloud.capacity import StepTime
from specsplit.cloud.gateway.lease import Lease
from specsplit.cloud.gateway.session import Code, Commit, Finish, GatewaySession, ProtocolError
from specsplit.shared.acceptance import VerificationRule
from specsplit.shared.protocol import pb, sparse_from_pb
from specsplit.shared.sampling import SparseDist


async def _unbudgeted(committed_len: int) -> None:
    pass


class Round:
    """The steps of one session: ``session`` (its committed prefix and stops), the ``lease`` on
    its Triton sequence, the gateway's ``steps`` (recent pass times, for Started.step_ms),
    ``working``: marks a step in flight (cloud.gateway.admission: such a session is never
    reclaimed), and ``reserve``: reserves the KV slot a step at a committed length needs before the
    step may grow it (cloud.gateway.admission; raises Refused when the memory is not there)."""

    def __init__(
        self,
        session: GatewaySession,
        lease: Lease,
        steps: StepTime,
        working: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        reserve: Callable[[int], Awaitable[None]] = _unbudgeted,
    ):
        self.session, self.lease, self.steps = session, lease, steps
        self.working, self.reserve = working, reserve

    def check(self, draft: pb.Draft, exact_base: bool = True) -> list[SparseDist] | None:
        """Validates a Draft against the session (``GatewaySession.check_draft``) and returns
        its q (None unless the session verifies by rejection); raises ProtocolError."""
        self.session.check_draft(
            draft.base_len,
            draft.tokens,
            len(draft.q),
            exact_base=exact_base,
            continues=draft.continues,
            branch=draft.branch,
        )
        return (
            self._parse_q(draft)
            if self.session.verification is VerificationRule.REJECTION
            else None
        )

    def _parse_q(self, draft: pb.Draft) -> list[SparseDist]:
        lim = self.session.limits
        qs = []
        for i, (d, msg) in enumerate(zip(draft.tokens, draft.q, strict=True)):
            if len(msg.token_ids) > lim.max_q_entries:
                raise ProtocolError(
                    Code.INVALID_ARGUMENT,
                    f"q[{i}] has {len(msg.token_ids)} entries, "
                    f"over max_q_entries {lim.max_q_entries}",
                )
            try:
                q = sparse_from_pb(msg, lim.vocab_size)
            except ValueError as e:
                raise ProtocolError(Code.INVALID_ARGUMENT, f"q[{i}]: {e}") from None
            if q.prob_of(d) <= 0:
                raise ProtocolError(
                    Code.INVALID_ARGUMENT, f"draft token {d} at {i} is outside q[{i}]'s support"
                )
            qs.append(q)
        return qs

    async def verdict(
        self, drafts: Sequence[int], q: list[SparseDist] | None, t0: float
    ) -> pb.Verdict:
        """One target step verifying ``drafts`` (none: the target's own next token) after the
        committed prefix; ``t0`` is when the step's work began (Timings.server_ms)."""
        session = self.session
        tokens = [session.committed[-1], *drafts]
        # A lost session or a failed replica re-opens from the committed prefix in there.
        with self.working():
            await self.reserve(session.committed_len)
            reply = await self.lease.step(session.committed, tokens, q or None)
        commit: Commit = session.commit(drafts, reply.accepted, reply.token)
        self.steps.observe(len(tokens), reply.batch_rows, reply.verify_ms)
        return pb.Verdict(
            accepted=commit.accepted,
            token=commit.token or 0,
            has_token=commit.token is not None,
            committed_len=commit.committed_len,
            finished=commit.finish is not Finish.NONE,
            reason=int(commit.finish),
            timings=pb.Timings(
                verify_ms=reply.verify_ms,
                server_ms=(time.perf_counter() - t0) * 1e3,
                queue_ms=max(0.0, reply.roundtrip_ms - reply.verify_ms),
                batch_sessions=reply.batch_sessions,
                batch_rows=reply.batch_rows,
            ),
            max_draft_tokens_hint=min(reply.max_draft_tokens_hint, session.limits.max_draft_tokens),
        )
