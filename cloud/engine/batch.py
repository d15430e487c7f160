"""Continuous batching for the target: requests from any number of Triton execute() calls are
served by one engine thread, one ``TargetModel.run`` (one forward pass) per batch.

Why not let Triton's scheduler form the batches: in a closed loop, the sessions served by a pass
send their next request a few ms after its responses, by which time the scheduler has already
started the next pass with whatever had queued meanwhile. The sessions then split into groups
that alternate, each pass carrying about half of them, at any queue delay (Triton measures the
delay from the oldest queued request, which has long expired). The engine instead waits, after
a pass, for the sessions it just served (those that usually come back quickly) before starting
the next, at most ``gather`` ms (a small fraction of a pass), so every live session rides in the
same pass.

model.py returns from execute() at once and answers through each request's response sender, so
Triton keeps delivering requests while a pass runs. An Open is answered when its prompt is all
prefilled (``TargetModel.step``), which may take several passes: the engine keeps running passes
while prompts wait, and every request queued meanwhile rides in the next. Plain Python,
unit-testable with a fake target.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from specsplit.cloud.engine.target import PREFILLING, Open, PassInfo, Request, Verify

log = logging.getLogger(__name__)

Respond = Callable[[object, PassInfo | None], None]  # (outcome or exception, pass info)


@dataclass
class _Item:
    request: Request
    respond: Respond


class BatchEngine:
    def __init__(
        self,
        target,
        idle_s: float = 600.0,
        max_gather_ms: float = 25.0,
        gather_fraction: float = 0.15,
    ):
        self.target, self.idle_s = target, idle_s
        self.max_gather_ms, self.gather_fraction = max_gather_ms, gather_fraction
        self._queue: list[_Item] = []
        self._cond = threading.Condition()
        self._stopped = False
        self._served: set[int] = set()  # sessions of the last pass: their next request is due
        self._sent_at: dict[int, float] = {}
        self._turnaround_ms: dict[int, float] = {}  # per session: response -> next request
        self._last_pass_ms = 0.0
        self._prefilling: dict[int, list[_Item]] = {}  # per sid: Opens whose prompt still runs
        self.passes = 0
        self._thread = threading.Thread(target=self._loop, name="specsplit-engine", daemon=True)
        self._thread.start()

    def submit(self, items: list[tuple[Request, Respond]]) -> None:
        now = time.monotonic()
        with self._cond:
            for request, respond in items:
                sent = self._sent_at.pop(request.sid, None)
                if sent is not None:
                    ms = (now - sent) * 1e3
                    old = self._turnaround_ms.get(request.sid, ms)
                    self._turnaround_ms[request.sid] = old + 0.3 * (ms - old)
                self._queue.append(_Item(request, respond))
            self._cond.notify()

    def stop(self, timeout_s: float = 30.0) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout_s)
        waiting = [item for items in self._prefilling.values() for item in items]
        self._prefilling = {}
        for item in waiting + self._take():
            item.respond(RuntimeError("the target is shutting down"), None)

    @property
    def gather_ms(self) -> float:
        return min(self.max_gather_ms, self.gather_fraction * self._last_pass_ms)

    def _due(self) -> set[int]:
        """Sessions served by the last pass that usually return within the gather window and
        have not yet."""
        queued = {item.request.sid for item in self._queue}
        limit = self.gather_ms
        return {
            sid
            for sid in self._served - queued
            if self._turnaround_ms.get(sid, 0.0) <= limit and sid in self._sent_at
        }

    def _take(self) -> list[_Item]:
        with self._cond:
            items, self._queue = self._queue, []
            return items

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._prefilling and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                deadline = time.monotonic() + self.gather_ms / 1e3
                while self._due() and not self._stopped:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                items, self._queue = self._queue, []
            self._serve(items)

    def _serve(self, items: list[_Item]) -> None:
        finished: list[tuple[int, object]] = []
        try:
            self.target.evict_idle(self.idle_s)
            t0 = time.monotonic()
            outcomes, info, finished = self.target.step([item.request for item in items])
            self._last_pass_ms = info.ms if info and info.ms else (time.monotonic() - t0) * 1e3
        except Exception as e:  # never let the engine thread die
            log.exception("batch failed")
            outcomes, info = [e] * len(items), None
            finished = self._abandon_prefills(e)
        self.passes += 1
        answered: list[tuple[_Item, object]] = []
        for item, outcome in zip(items, outcomes, strict=True):
            if outcome is PREFILLING:
                self._prefilling.setdefault(item.request.sid, []).append(item)
            else:
                answered.append((item, outcome))
        for sid, outcome in finished:  # after this batch's Opens are held: theirs may be here
            waiting = self._prefilling.get(sid)
            if not waiting:
                log.warning("a prefill of session %d ended with no Open waiting for it", sid)
                continue
            answered.append((waiting.pop(0), outcome))
            if not waiting:
                del self._prefilling[sid]
        self._record(answered)
        for item, outcome in answered:
            try:
                item.respond(outcome, info)
            except Exception:
                log.exception("sending a response failed")

    def _abandon_prefills(self, error: Exception) -> list[tuple[int, object]]:
        """After a step that raised: every waiting Open fails, its session ended."""
        out = []
        for sid, items in self._prefilling.items():
            try:
                self.target.end(sid)
            except Exception:
                log.exception("ending session %d failed", sid)
            out += [(sid, error)] * len(items)
        self.target.take_finished()  # answered here, with the step's error
        return out

    def _record(self, answered: list[tuple[_Item, object]]) -> None:
        """Sessions answered now whose next request is due (the gather window waits for them)."""
        served = set()
        now = time.monotonic()
        with self._cond:
            for item, outcome in answered:
                request = item.request
                ongoing = isinstance(request, Open | Verify) and not isinstance(outcome, Exception)
                if ongoing and not (isinstance(request, Verify) and request.end):
                    served.add(request.sid)
                    self._sent_at[request.sid] = now
                else:
                    self._turnaround_ms.pop(request.sid, None)
                    self._sent_at.pop(request.sid, None)
            self._served = served
