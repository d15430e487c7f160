"""BatchEngine with a fake target: batches across submits, waits for the sessions it just served,
answers every request once, survives a failing batch."""

import threading
import time

from specsplit.cloud.engine import batch
from specsplit.cloud.engine.batch import BatchEngine
from specsplit.cloud.engine.target import Close, Open, PassInfo, SessionParams, Verify
from specsplit.shared.acceptance import VerificationRule
from specsplit.shared.sampling import SamplingConfig

P = SessionParams(SamplingConfig(), VerificationRule.GREEDY)


class VirtualClock:
    """The engine's clock (``batch.time``) in a test: time moves only when the test moves it, so
    what the engine decides from its clock (the gather deadline, each session's turnaround) does
    not depend on how fast this machine runs the threads."""

    def __init__(self):
        self._now, self._lock = 1000.0, threading.Lock()

    def monotonic(self) -> float:
        with self._lock:
            return self._now

    def advance_to(self, t: float) -> None:
        with self._lock:
            self._now = max(self._now, t)


class FakeTarget:
    """A pass takes ``pass_s``: slept, or on a VirtualClock moved on by that much."""

    def __init__(self, pass_s: float = 0.05, fail: bool = False, clock: VirtualClock | None = None):
        self.pass_s, self.fail, self.clock = pass_s, fail, clock
        self.during_first_pass = None  # called while the first pass runs
        self.batches: list[list[int]] = []
        self.sessions: dict = {}

    def evict_idle(self, idle_s):
        return []

    def step(self, requests):
        if self.fail:
            raise RuntimeError("boom")
        self.batches.append(sorted(r.sid for r in requests))
        if len(self.batches) == 1 and self.during_first_pass is not None:
            self.during_first_pass()
        if self.clock is None:
            time.sleep(self.pass_s)
        else:
            self.clock.advance_to(self.clock.monotonic() + self.pass_s)
        info = PassInfo(len(requests), len(requests), self.pass_s * 1e3, 4)
        return [None] * len(requests), info, []

    def end(self, sid):
        return False

    def take_finished(self):
        return []


def closed_loop(engine, target, first, late, rounds, clock: VirtualClock, turnaround_s=0.002):
    """Sessions ``first`` send their first request together; ``late`` theirs while the first
    pass runs (so they start a pass behind: the alternating halves a scheduler that does not
    wait would keep). Each then sends its next request ``turnaround_s`` after its response, like
    the gateway: from its own thread, at a real moment the engine cannot predict, and at that
    much past the response on the engine's clock (sessions turn around together, not in turn)."""
    done = threading.Event()
    remaining = {sid: rounds for sid in [*first, *late]}
    lock = threading.Lock()
    threads = []

    def responder(sid):
        def respond(outcome, info):
            answered, passes = clock.monotonic(), len(target.batches)
            with lock:
                remaining[sid] -= 1
                left = remaining[sid]
            if left > 0:
                args = ([sid], answered + turnaround_s, left == 1, passes)
                t = threading.Thread(target=send, args=args)
                threads.append(t)
                t.start()
            elif all(v == 0 for v in remaining.values()):
                done.set()

        return respond

    def send(sids, at=None, last=False, passes=None):
        if passes is not None:
            # Always after the engine has decided what to do next: it waits (its condition has
            # a waiter: CPython's Condition._waiters) or it has started the next pass. A
            # session never comes back before then, the case where the engine would not wait.
            while not (engine._cond._waiters or len(target.batches) > passes or engine._stopped):
                time.sleep(0.001)
        if at is not None:
            clock.advance_to(at)
        # a session's last round ends it (Verify.end), as the gateway's last round does
        engine.submit([(Verify(sid, 1, [0], end=last), responder(sid)) for sid in sids])

    target.during_first_pass = lambda: send(late)
    send(first)
    assert done.wait(30)
    for t in threads:
        t.join()


def test_closed_loop_sessions_stay_in_one_pass(monkeypatch):
    """A pass of 50 ms, sessions that come back 2 ms after it (within its gather window of
    0.15 x 50 = 7.5 ms, BatchEngine.gather_ms): after each pass the engine waits for the
    sessions it served, however late their threads run, so two halves that started a pass apart
    ride together from the second pass on, and every pass carries every live session."""
    clock = VirtualClock()
    monkeypatch.setattr(batch, "time", clock)  # the engine's clock only, not the test's
    target = FakeTarget(pass_s=0.05, clock=clock)
    engine = BatchEngine(target)
    try:
        closed_loop(engine, target, range(4), range(4, 8), rounds=10, clock=clock)
    finally:
        engine.stop()
    # 0-3 alone, then all 8 together for 0-3's other 9 rounds, then 4-7's last round alone.
    assert target.batches == [[0, 1, 2, 3], *[list(range(8))] * 9, [4, 5, 6, 7]]


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
