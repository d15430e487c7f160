"""edge.session_plan.SessionPlan.settled: the mode a Started says the server runs."""

from __future__ import annotations

import pytest

from specsplit.edge.generation import GenerationConfig
from specsplit.edge.session_plan import SessionPlan
from specsplit.edge.stream import SpecsplitError
from specsplit.shared.protocol import pb
from specsplit.shared.session_mode import SessionMode


def _plan(session_mode: str) -> SessionPlan:
    return SessionPlan.of(GenerationConfig(session_mode=session_mode))


def test_the_mode_the_server_runs_is_the_mode_settled():
    started = pb.Started(session_mode=pb.SESSION_MODE_CLOUD_LED)
    assert _plan("cloud-led").settled(started, None).mode is SessionMode.CLOUD_LED


def test_a_cloud_led_ask_may_run_lock_step():
    started = pb.Started(session_mode=pb.SESSION_MODE_LOCK_STEP)
    assert _plan("cloud-led").settled(started, None).mode is SessionMode.LOCK_STEP


def test_a_started_without_a_session_mode_is_an_error():
    """The deprecated Started.cloud_led is gone: a Started must name its mode."""
    with pytest.raises(SpecsplitError, match="no known session_mode"):
        _plan("lock-step").settled(pb.Started(), None)


def test_a_mode_other_than_the_one_asked_is_an_error():
    started = pb.Started(session_mode=pb.SESSION_MODE_CLOUD_LED)
    with pytest.raises(SpecsplitError, match="asked for session mode"):
        _plan("lock-step").settled(started, None)
