"""Generations behind the OpenAI endpoint: a pool of clients, each with its own drafter, and one
task per generation so that ending it early is a clean cancel.

A drafter's KV cache belongs to one sequence, so concurrent requests each need their own: the pool
holds ``size`` slots, each a ``SplitClient`` with its own drafter, made on first use (the
endpoint's drafters share one ONNX Runtime session, ``OnnxDrafter.another``: one copy of the
weights and one thread pool, whatever ``size``). Requests beyond ``size`` wait for a slot, first
come first served (asyncio's queues wake their waiters in order).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import suppress

from specsplit.edge.client import SplitClient
from specsplit.edge.generation import Generation
from specsplit.edge.openai.schema import RequestPlan

log = logging.getLogger(__name__)


class ClientPool:
    def __init__(self, size: int, make_drafter: Callable[[], object] | None, **client_kwargs):
        """``make_drafter`` (blocking: it loads the ONNX model) returns a new drafter; None for
        cloud-only serving. ``client_kwargs`` go to every ``SplitClient`` (address, TLS, token)."""
        if size < 1:
            raise ValueError(f"the pool needs at least one slot, got {size}")
        self.size = size
        self._make_drafter = make_drafter
        self._client_kwargs = client_kwargs
        # Last in, first out: a client made earlier is reused before another drafter is loaded.
        self._free: asyncio.LifoQueue[SplitClient | None] = asyncio.LifoQueue()
        for _ in range(size):
            self._free.put_nowait(None)  # a slot whose client is not made yet
        self._made: list[SplitClient] = []

    async def acquire(self) -> SplitClient:
        """A free slot's client (waits while all are busy); give it back with ``release``."""
        client = await self._free.get()
        if client is not None:
            return client
        try:
            # Loading a draft takes a while: off the event loop, so other requests keep flowing.
            make = self._make_drafter
            drafter = await asyncio.to_thread(make) if make is not None else None
            client = SplitClient(drafter=drafter, **self._client_kwargs)
        except BaseException:
            self._free.put_nowait(None)
            raise
        self._made.append(client)
        log.info("client %d of %d ready", len(self._made), self.size)
        return client

    def release(self, client: SplitClient) -> None:
        self._free.put_nowait(client)

    async def close(self) -> None:
        for client in self._made:
            await client.close()
        self._made.clear()


class Run:
    """One generation, consumed by its own task into a queue of committed chunks.

    ``close`` cancels that task where it waits, inside the client's stream: the client cancels
    the gRPC call (the cloud frees the session and its KV cache) and waits for its draft-ahead
    worker to leave the drafter. Only then may the slot serve another request. (Leaving an
    ``async for`` with ``break`` would instead leave the stream suspended until garbage
    collection.)
    """

    def __init__(self, client: SplitClient, plan: RequestPlan, route: str):
        self.gen: Generation = client.generate(plan.prompt_ids, plan.config, route)
        # perf_counter seconds: the request taken (the endpoint sets it), the generation begun
        # (its statistics' times count from here, give or take the task's first step)
        self.taken = self.began = time.perf_counter()
        self._events: asyncio.Queue[list[int] | BaseException | None] = asyncio.Queue()
        self._task = asyncio.create_task(self._consume())

    async def _consume(self) -> None:
        try:
            async for chunk in self.gen:
                # Never await outside the stream: a cancel must land inside it (see the class doc).
                self._events.put_nowait(chunk)
        except Exception as e:  # handed to the reader, which turns it into an HTTP error
            self._events.put_nowait(e)
        else:
            self._events.put_nowait(None)

    async def next(self) -> list[int] | None:
        """The next committed chunk; None once the generation is over. Raises its error."""
        event = await self._events.get()
        if isinstance(event, BaseException):
            raise event
        return event

    async def close(self) -> None:
        """Ends the generation if it still runs, and returns once it has let go of everything,
        even when the caller is cancelled meanwhile (the caller's cancel is re-raised after)."""
        self._task.cancel()
        cancelled = False
        while not self._task.done():
            try:
                await asyncio.wait({self._task})
            except asyncio.CancelledError:
                cancelled = True
        with suppress(asyncio.CancelledError):
            self._task.result()
        if cancelled:
            raise asyncio.CancelledError
