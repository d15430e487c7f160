"""edge.sequence.Committed: the committed sequence a stream's loop owns, and the proto's
invariant that both sides agree on committed_len, checked before a chunk is handed on."""

from __future__ import annotations

import grpc
import pytest

from specsplit.edge.sequence import Committed
from specsplit.shared.protocol import pb


def test_commit_appends_and_keeps_its_own_copy_of_the_prompt():
    prompt = [1, 2]
    seq = Committed(prompt)
    seq.commit([5, 6], pb.Verdict(accepted=1, token=6, has_token=True, committed_len=4))
    assert seq.tokens == [1, 2, 5, 6] and len(seq) == 4
    assert prompt == [1, 2] and seq.final == ""


def test_a_final_verdict_that_agrees_sets_the_finish_reason():
    seq = Committed([1])
    final = pb.Verdict(
        token=3, has_token=True, committed_len=2, finished=True, reason=pb.FINISH_REASON_EOS
    )
    seq.commit([3], final)
    assert seq.final == "EOS"


def test_a_verdict_with_another_committed_len_is_a_retryable_error_naming_both():
    seq = Committed([1, 2, 3])
    v = pb.Verdict(round=4, token=9, has_token=True, committed_len=5, finished=True)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        seq.commit([9], v)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE  # edge.client re-opens
    assert "round 4 says committed_len 5, the edge committed 4" in e.value.details()
    assert seq.final == ""  # a disputed final Verdict does not finish the generation
