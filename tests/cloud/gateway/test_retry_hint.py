"""The retry hint of a refusal (cloud.gateway.admission.Admission.retry_after_ms): when a place or
KV memory is likely to come back, so that a refused edge neither hammers the cloud nor waits
longer than it must."""

from __future__ import annotations

import pytest

from specsplit.cloud.gateway.admission import Admission, Refused
from tests.cloud.gateway.fakes import FakeControl


def test_streams_not_yet_admitted_count_for_the_hint():
    """Every place held by streams whose Start is still on its way (a burst of edges): the hint
    is their sessions' expected end, not the reclaim grace (5 s) of streams just opened."""
    admission = Admission(max_sessions=2)
    for _ in range(2):
        admission.enter(None).attach(FakeControl())
    with pytest.raises(Refused) as refused:
        admission.enter(None)
    assert refused.value.retry_after_ms <= 1000  # the mean session: 1 s until one has ended
