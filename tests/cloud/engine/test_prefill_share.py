"""Prefill rows per pass shared among clients (issue 39, item 4): one long prompt never holds
other sessions' steps for its whole prefill, nor takes a pass's rows while another client's
prompt waits; a pass beside verification rows carries fewer prompt rows where rows cost time."""

import threading

import numpy as np
import pytest

from specsplit.cloud.capacity import CostModel
from specsplit.cloud.engine import target as target_mod
from specsplit.cloud.engine.batch import BatchEngine
from specsplit.cloud.engine.target import (
    PREFILLING,
    Close,
    Open,
    SessionNotFound,
    SessionParams,
    TargetModel,
    Verify,
)
from specsplit.shared.acceptance import VerificationRule
from specsplit.shared.sampling import SamplingConfig
from specsplit.shared.tiny import make_tiny_qwen2, reference_greedy

GREEDY = SessionParams(SamplingConfig(), VerificationRule.GREEDY)
CHUNK = 64


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_qwen2(tmp_path_factory.mktemp("t") / "target", seed=0)


@pytest.fixture
def target(target_dir, monkeypatch):
    monkeypatch.setattr(target_mod, "PREFILL_CHUNK", CHUNK)
    return TargetModel(target_dir, device="cpu", calibrate=False, weights="float")


def _prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, size=n).tolist()


def test_a_long_prompt_does_not_hold_another_sessions_step(target, target_dir):
    target.run([Open(2, [4, 5, 6], GREEDY)])
    long = _prompt(301)
    outcomes, _, finished = target.step([Open(1, long, GREEDY, client=7), Verify(2, 3, [6])])
    assert outcomes[0] is PREFILLING
    assert outcomes[1].result.token == reference_greedy(target_dir, [4, 5, 6], 1)[0]
    assert finished == []
    passes = 1
    while not finished:
        _, _, finished = target.step([])
        passes += 1
    assert finished == [(1, None)] and passes == -(-300 // CHUNK)
    [v], _ = target.run([Verify(1, 301, [long[-1]])])
    assert v.result.token == reference_greedy(target_dir, long, 1)[0]


def test_prompt_rows_are_shared_evenly_among_clients(target, target_dir):
    many = [Open(sid, _prompt(301, sid), GREEDY, client=1) for sid in range(3)]
    other = Open(10, _prompt(301, 10), GREEDY, client=2)
    target.step([*many, other])
    held = {sid: target.sessions[sid].slot.length for sid in (0, 1, 2, 10)}
    # Client 1's three prompts share its half evenly; client 2's one gets the other half.
    assert held == {0: 11, 1: 11, 2: 10, 10: CHUNK // 2}
    finished = []
    while len(finished) < 4:
        finished += target.step([])[2]
    assert finished[0] == (10, None)  # the lone prompt of client 2 is not queued behind client 1's
    [v], _ = target.run([Verify(10, 301, [other.prompt[-1]])])
    assert v.result.token == reference_greedy(target_dir, list(other.prompt), 1)[0]


def test_one_clients_short_prompt_is_not_queued_behind_its_long_one(target):
    """Clients behind one proxy address without tokens are one client: their prompts share
    its rows evenly too, not in arrival order."""
    _, _, finished = target.step(
        [Open(1, _prompt(301), GREEDY, client=1), Open(2, [1, 2, 3, 4, 5], GREEDY, client=1)]
    )
    assert finished == [(2, None)]
    assert target.sessions[1].slot.length == CHUNK - 4


def test_a_client_needing_less_leaves_its_rows_to_others(target):
    target.step([Open(1, _prompt(301), GREEDY, client=1), Open(2, [1, 2, 3, 4, 5], GREEDY)])
    assert target.sessions[2].slot.length == 4
    assert target.sessions[1].slot.length == CHUNK - 4


def test_prompt_rows_beside_steps_keep_the_pass_within_the_slowdown(target):
    target.cost = CostModel()
    for rows, ms in {1: 10, 4: 12, 16: 20, 64: 80}.items():  # rows cost time past 4
        target.cost.observe(rows, ms)
    assert target._prefill_budget(0) == CHUNK  # alone: the whole chunk
    assert target._prefill_budget(4) == target_mod.MIN_PREFILL_ROWS  # 2x of 12 ms: 16 rows
    target.run([Open(2, [4, 5, 6], GREEDY)])
    target.step([Open(1, _prompt(301), GREEDY, client=1), Verify(2, 3, [6])])
    assert target.sessions[1].slot.length == target_mod.MIN_PREFILL_ROWS


def test_a_long_prompt_yields_to_a_short_one_where_rows_cost_time(target):
    target.cost = CostModel()
    for rows, ms in {1: 10, 4: 12, 16: 20, 64: 80}.items():
        target.cost.observe(rows, ms)
    target.step([Open(1, _prompt(301), GREEDY, client=1), Open(2, [1, 2, 3, 4, 5], GREEDY)])
    assert target.sessions[2].slot.length == 4  # all of it, in one pass
    # The long prompt's rows keep that pass within 2x of the short one's 4 rows: 16, not 60.
    assert target.sessions[1].slot.length == target_mod.MIN_PREFILL_ROWS


def test_an_open_ended_during_its_prefill_is_answered_session_not_found(target):
    target.step([Open(1, _prompt(301), GREEDY, client=1)])
    outcomes, _, finished = target.step([Close(1)])
    assert outcomes == [None]
    [(sid, error)] = finished
    assert sid == 1 and isinstance(error, SessionNotFound)
    assert 1 not in target.sessions and not target.prefills


def test_a_step_for_a_session_still_prefilling_is_refused(target):
    target.step([Open(1, _prompt(301), GREEDY, client=1)])
    [error], _, _ = target.step([Verify(1, 301, [3])])
    assert isinstance(error, ValueError) and "still prefilling" in str(error)


def test_engine_answers_a_step_before_a_long_prompt_beside_it(target):
    target.run([Open(2, [4, 5, 6], GREEDY)])
    order: list[str] = []
    done = threading.Event()

    def respond(name):
        def answer(outcome, info):
            assert not isinstance(outcome, Exception), outcome
            order.append(name)
            if len(order) == 2:
                done.set()

        return answer

    engine = BatchEngine(target)
    try:
        engine.submit(
            [
                (Open(1, _prompt(1001), GREEDY, client=7), respond("open")),
                (Verify(2, 3, [6]), respond("step")),
            ]
        )
        assert done.wait(60)
    finally:
        engine.stop()
    assert order == ["step", "open"]
    assert target.sessions[1].slot.length == 1000
