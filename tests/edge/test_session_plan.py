"""edge.session_plan.SessionPlan: the mode an auto stream asks for at Start (``of``), and the
mode a Started says the server runs (``settled``)."""

from __future__ import annotations

import pytest

from specsplit.edge.generation import GenerationConfig
from specsplit.edge.mode_switch import Link, Yield
from specsplit.edge.session_plan import SessionPlan
from specsplit.edge.stream import SpecsplitError
from specsplit.shared.protocol import pb
from specsplit.shared.sampling import SamplingConfig
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


GREEDY = GenerationConfig()
SAMPLED = GenerationConfig(sampling=SamplingConfig(temperature=0.7))
SEEDED = GenerationConfig(sampling=SamplingConfig(temperature=0.7), seed=5)  # must repeat
STAYED = Link(0.5, 50.0, lock_step=Yield(2.0, 90.0))  # an auto run measured lock-step, stayed
PAID = Link(0.5, 50.0, led=True, cloud_led=Yield(2.5, 60.0))  # an auto run led, and it paid


@pytest.mark.parametrize(
    ("cfg", "link", "mode"),
    [
        (GREEDY, None, SessionMode.CLOUD_LED),  # cold and greedy: cloud-led from Start
        (GREEDY, Link(0.5, 50.0), SessionMode.CLOUD_LED),  # only the target alone ran: cold
        (GREEDY, STAYED, SessionMode.LOCK_STEP),  # the link says lock-step
        (GREEDY, PAID, SessionMode.CLOUD_LED),
        (SAMPLED, None, SessionMode.CLOUD_LED),  # cold and sampled (no seed): cloud-led too
        (SAMPLED, STAYED, SessionMode.LOCK_STEP),
        (SAMPLED, PAID, SessionMode.CLOUD_LED),
        (SEEDED, None, SessionMode.LOCK_STEP),  # a fixed k, no switch
        (GenerationConfig(adaptive=False), None, SessionMode.LOCK_STEP),
        (GenerationConfig(session_mode="lock-step"), None, SessionMode.LOCK_STEP),
    ],
)
def test_an_auto_stream_starts_cloud_led_where_nothing_is_measured(cfg, link, mode):
    """edge.session_plan._leads_from_start: cloud-led from Start beat lock-step rounds that hand
    over (docs/design.md#auto), so a stream with no auto generation measured on its link starts
    cloud-led, greedy or sampled; a run that must repeat, and a link whose auto run stayed
    lock-step, start lock-step."""
    assert SessionPlan.of(cfg, link=link).mode is mode
