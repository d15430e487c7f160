"""Keeps `serve`'s tritonservers running (docs/design.md#failure): a server that exits without being
asked to, or whose Python backend stub died under it (Triton then fails every request and never
starts the stub again), is cleaned up (its process group, where the stub of a crashed server
would live on as an orphan, and its shared-memory regions) and started again on the same port,
with bounded backoff.

The gateway notices nothing but a replica that is down for a while: its health watch marks it
up again once the model is ready, and the sessions that were on it re-open from their committed
prefix (cloud/gateway/lease.py).
"""

from __future__ import annotations

import asyncio
import logging
import time

from specsplit.cloud.supervision.triton import TritonError, TritonServer

log = logging.getLogger(__name__)

BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0)  # then 30 s between tries, forever
STABLE_S = 60.0  # a server up this long has recovered: the next crash starts the backoff over


class TritonSupervisor:
    def __init__(self, server: TritonServer, poll_s: float = 0.5, backoff_s=BACKOFF_S):
        self.server = server
        self.poll_s = poll_s
        self.backoff_s = tuple(backoff_s)
        self.restarts = 0  # successful restarts, for logs and tests
        self._failures = 0  # consecutive: picks the next pause
        self._up_since = time.monotonic()

    async def run(self) -> None:
        """Runs until cancelled; cancel it before stopping the server."""
        while True:
            await asyncio.sleep(self.poll_s)
            if self.server.exited:
                code = self.server.proc.returncode if self.server.proc else None
                await self._recover(f"exited (code {code})")
            elif self.server.stub_lost:
                await self._recover("lost its Python backend stub")

    async def _recover(self, why: str) -> None:
        if time.monotonic() - self._up_since >= STABLE_S:
            self._failures = 0
        while True:
            pause = self.backoff_s[min(self._failures, len(self.backoff_s) - 1)]
            log.error(
                "tritonserver on %s %s; restarting in %.1f s",
                self.server.url,
                why,
                pause,
            )
            await asyncio.sleep(pause)
            try:
                await asyncio.to_thread(self.server.restart)
            except TritonError as e:
                self._failures += 1
                log.error("tritonserver restart failed: %s", e)
                continue
            except Exception:  # an OSError, say: the supervisor must outlive any one failure
                self._failures += 1
                log.exception("tritonserver restart failed")
                continue
            self._failures += 1
            self.restarts += 1
            self._up_since = time.monotonic()
            log.warning("tritonserver on %s restarted (%d so far)", self.server.url, self.restarts)
            return
