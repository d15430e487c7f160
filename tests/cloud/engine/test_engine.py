"""BatchEngine with a fake target: batches across submits, waits for the sessions it just served,
answers every request once, survives a failing batch."""

import threading
import time

from specsplit.cloud.engine.batch import BatchEngine
from specsplit.cloud.engine.target import Close, Open, PassInfo, SessionParams, Verify
from specsplit.shared.acceptance import VerificationMode
from specsplit.shared.sampling import SamplingConfig

P = SessionParams(SamplingConfig(), VerificationMode.GREEDY)


class FakeTarget:
    def __init__(self, pass_s: float = 0.05, fail: bool = False):
        self.pass_s, self.fail = pass_s, fail
        self.batches: list[list[int]] = []
        self.sessions: dict = {}

    def evict_idle(self, idle_s):
        return []

    def step(self, requests):
        if self.fail:
            raise RuntimeError("boom")
        self.batches.append(sorted(r.sid for r in requests))
        time.sleep(self.pass_s)
        info = PassInfo(len(requests), len(requests), self.pass_s * 1e3, 4)
        return [None] * len(requests), info, []

    def end(self, sid):
        return False

    def take_finished(self):
        return []


def closed_loop(engine, sids, rounds, turnaround_s=0.002):
    """Each session sends its next request shortly after its response, like the gateway."""
    done = threading.Event()
    remaining = {sid: rounds for sid in sids}
    lock = threading.Lock()

    def responder(sid):
        def respond(outcome, info):
            with lock:
                remaining[sid] -= 1
                left = remaining[sid]
            if left > 0:
                threading.Timer(turnaround_s, send, (sid,)).start()
            elif all(v == 0 for v in remaining.values()):
                done.set()

        return respond

    def send(sid):
        engine.submit([(Verify(sid, 1, [0]), responder(sid))])

    for sid in sids:
        send(sid)
    assert done.wait(30)


def test_closed_loop_sessions_stay_in_one_pass():
    target = FakeTarget(pass_s=0.05)
    engine = BatchEngine(target)
    try:
        closed_loop(engine, range(8), rounds=10)
    finally:
        engine.stop()
    # After the first pass or two, every pass carries all 8 sessions (no alternating halves).
    assert all(len(b) == 8 for b in target.batches[3:]), target.batches
    assert len(target.batches) <= 13


def test_every_request_is_answered_once_even_when_a_batch_fails():
    answers = []
    engine = BatchEngine(FakeTarget(fail=True))
    try:
        engine.submit([(Open(1, [1, 2], P), lambda o, i: answers.append(o))])
        engine.submit([(Close(1), lambda o, i: answers.append(o))])
        for _ in range(100):
            if len(answers) == 2:
                break
            time.sleep(0.01)
    finally:
        engine.stop()
    assert len(answers) == 2 and all(isinstance(a, RuntimeError) for a in answers)


def test_stop_answers_what_is_queued():
    target = FakeTarget(pass_s=0.3)
    engine = BatchEngine(target)
    answers = []
    engine.submit([(Verify(1, 1, [0]), lambda o, i: answers.append(o))])
    time.sleep(0.05)  # the first pass is running
    engine.submit([(Verify(2, 1, [0]), lambda o, i: answers.append(o))])
    engine.stop()
    assert len(answers) == 2
