"""The draft-ahead worker: drafting in a thread while a verdict is in flight, stoppable."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

from specsplit.edge.drafting import Drafter, Interrupted

T = TypeVar("T")


class Stopped(Exception):
    """The draft-ahead worker was told to stop (its generation ended)."""


class Stoppable:
    """The drafter as the draft-ahead worker sees it: each forward pass first checks ``stop``, and
    a pass the drafter's ``interrupt()`` cut short (``Interrupted``) stops the worker too."""

    def __init__(self, drafter: Drafter, stop: threading.Event):
        self._drafter, self._stop = drafter, stop
        self.vocab_size, self.eos_token_ids = drafter.vocab_size, drafter.eos_token_ids

    @property
    def cached(self) -> list[int]:
        return self._drafter.cached

    def truncate(self, n: int) -> None:
        self._drafter.truncate(n)

    def forward(self, tokens: Sequence[int], all_logits: bool = False) -> np.ndarray:
        if self._stop.is_set():
            raise Stopped
        try:
            if all_logits:  # only drafters that take it are asked (edge.drafting.greedy_after)
                return self._drafter.forward(tokens, all_logits=True)
            return self._drafter.forward(tokens)
        except Interrupted:  # the drafter's interrupt(): told to stop mid-pass
            raise Stopped from None


class Worker:
    """``fn(*args, stop)`` in a thread. Its future is only ever awaited through a shield, so a
    cancelled await never detaches the thread: ``join`` stops it at the next forward pass and
    returns once it has left the drafter, even when cancelled meanwhile."""

    def __init__(self, fn: Callable[..., T], *args):
        self.stop = threading.Event()
        self.future = asyncio.get_running_loop().run_in_executor(None, fn, *args, self.stop)

    async def result(self) -> T:
        return await asyncio.shield(self.future)

    async def join(self) -> None:
        self.stop.set()
        cancelled = False
        while not self.future.done():
            try:
                await asyncio.shield(self.future)
            except asyncio.CancelledError:
                cancelled = True
            except Exception:
                pass
        if cancelled:
            raise asyncio.CancelledError
