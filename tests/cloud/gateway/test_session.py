"""Gateway bookkeeping: validation codes and stop conditions (no gRPC, no Triton)."""

import pytest

from specsplit.cloud.gateway.session import Code, Finish, GatewaySession, ModelLimits, ProtocolError
from specsplit.shared.acceptance import VerificationRule
from specsplit.shared.sampling import SamplingConfig

LIMITS = ModelLimits(vocab_size=100, max_context=64, max_draft_tokens=4, eos_token_ids=(99,))


def session(
    max_new_tokens=10, stop_ids=frozenset(), verification=VerificationRule.GREEDY
) -> GatewaySession:
    return GatewaySession(
        LIMITS, [1, 2, 3], SamplingConfig(), verification, 0, max_new_tokens, stop_ids
    )


def test_commit_appends_accepted_then_token():
    s = session()
    c = s.commit([10, 11, 12], accepted=2, token=50)
    assert (c.accepted, c.token, c.committed_len, c.finish) == (2, 50, 6, Finish.NONE)
    assert s.committed == [1, 2, 3, 10, 11, 50]


def test_eos_inside_accepted_drafts_discards_the_rest():
    s = session()
    c = s.commit([10, 99, 12], accepted=3, token=50)
    assert (c.accepted, c.token, c.finish) == (2, None, Finish.EOS)
    assert s.committed == [1, 2, 3, 10, 99]


def test_stop_token_is_kept_and_stops():
    s = session(stop_ids=frozenset({50}))
    c = s.commit([10], accepted=1, token=50)
    assert (c.accepted, c.token, c.finish) == (1, 50, Finish.STOP_TOKEN)


def test_max_new_tokens_respected():
    s = session(max_new_tokens=2)
    c = s.commit([10, 11, 12], accepted=3, token=50)
    assert (c.accepted, c.token, c.finish) == (2, None, Finish.LENGTH)
    assert s.new_tokens == 2


@pytest.mark.parametrize(
    ("base_len", "tokens", "n_q", "code", "match"),
    [
        (4, [1], 0, Code.FAILED_PRECONDITION, "base_len"),
        (3, [1, 2, 3, 4, 5], 0, Code.INVALID_ARGUMENT, "max_draft_tokens"),
        (3, [100], 0, Code.INVALID_ARGUMENT, "outside the vocabulary"),
        (3, [1], 1, Code.INVALID_ARGUMENT, "only sent under the rejection rule"),
    ],
)
def test_check_draft_rejects(base_len, tokens, n_q, code, match):
    with pytest.raises(ProtocolError, match=match) as e:
        session().check_draft(base_len, tokens, n_q)
    assert e.value.code is code


def test_the_rejection_rule_needs_q_per_token():
    s = session(verification=VerificationRule.REJECTION)
    s.check_draft(3, [1, 2], 2)
    with pytest.raises(ProtocolError, match="needs q"):
        s.check_draft(3, [1, 2], 1)


def test_no_draft_after_finish():
    s = session(max_new_tokens=1)
    s.commit([], 0, 5)
    with pytest.raises(ProtocolError, match="finished") as e:
        s.check_draft(4, [1], 0)
    assert e.value.code is Code.FAILED_PRECONDITION


def test_continued_drafts_are_checked_against_the_block_limit():
    s = session()  # committed_len 3, max_draft_tokens 4
    s.check_draft(5, [1, 2], 0, exact_base=False, continues=True)  # reaches 7 = 3 + 4
    with pytest.raises(ProtocolError, match="past committed_len") as e:
        s.check_draft(5, [1, 2, 3], 0, exact_base=False, continues=True)
    assert e.value.code is Code.INVALID_ARGUMENT
    with pytest.raises(ProtocolError, match="base_len 5 > committed_len") as e:
        s.check_draft(5, [1], 0, exact_base=False)  # past committed_len, not a continuation
    assert e.value.code is Code.FAILED_PRECONDITION
    with pytest.raises(ProtocolError, match="only valid in a cloud_led") as e:
        s.check_draft(3, [1], 0, continues=True)  # lock-step
    assert e.value.code is Code.INVALID_ARGUMENT


def test_a_branch_is_cloud_led_only_and_sent_whole():
    s = session()  # committed_len 3
    s.check_draft(3, [1, 2], 0, exact_base=False, branch=True)
    with pytest.raises(ProtocolError, match="Draft.branch is only valid in a cloud_led") as e:
        s.check_draft(3, [1], 0, branch=True)  # lock-step
    assert e.value.code is Code.INVALID_ARGUMENT
    with pytest.raises(ProtocolError, match="a branch is sent whole") as e:
        s.check_draft(3, [1], 0, exact_base=False, continues=True, branch=True)
    assert e.value.code is Code.INVALID_ARGUMENT
