"""`specsplit-cloud serve` as a child process (demo, benchmarks, tests), always stopped.

The child runs in its own process group (a terminal's Ctrl-C reaches only the parent, which then
stops it: SIGINT, then SIGKILL of the whole group after a grace period), optionally pinned to
given CPU cores.
"""

from __future__ import annotations

import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from specsplit.cloud.supervision.triton import pinned, stop_process_group


class CloudProcess:
    READY = re.compile(r"ready on (\S+):(\d+) .*triton (\S+)\)")

    def __init__(
        self,
        *args: str,
        log_dir: Path,
        timeout_s: float = 300.0,
        cpus: Iterable[int] | None = None,
        python: str = sys.executable,  # another environment's interpreter (packaging tests)
    ):
        self.args = ["serve", "--port", "0", *args]
        self.python = python
        self.log_path = Path(log_dir) / "cloud.stderr.log"
        self.timeout_s = timeout_s
        self.cpus = set(cpus) if cpus is not None else None
        self.proc: subprocess.Popen | None = None
        self.address = self.triton_url = ""
        self.lines: queue.Queue[str] = queue.Queue()
        self._stderr = None

    def start(self) -> CloudProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._stderr = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        cpus = self.cpus
        self.proc = subprocess.Popen(
            pinned([self.python, "-m", "specsplit.cloud.cli", *self.args], cpus),
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            start_new_session=True,
        )
        threading.Thread(target=self._pump, daemon=True).start()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            if m := self.READY.search(line):
                self.address, self.triton_url = f"{m[1]}:{m[2]}", m[3]
                return
        tail = self.log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"specsplit-cloud did not get ready:\n{tail}")

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)

    def stop(self, grace_s: float = 30.0) -> int | None:
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        # The CLI stops Triton itself on SIGINT; the group kill then reaps any straggler.
        code = stop_process_group(proc, grace_s, signal_group=False)
        if self._stderr is not None:
            self._stderr.close()
        return code

    def __enter__(self) -> CloudProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
