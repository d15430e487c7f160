"""Real processes for end-to-end tests, always stopped (SIGINT, then SIGKILL of the group)."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


class CloudProcess:
    """`specsplit-cloud serve ...` in its own process group; parses the ready line."""

    READY = re.compile(r"ready on (\S+):(\d+) .*triton (\S+)\)")

    def __init__(self, *args: str, log_dir: Path, timeout_s: float = 240.0):
        self.args = ["serve", "--port", "0", *args]
        self.log_path = log_dir / "cloud.stderr.log"
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen | None = None
        self.address = self.triton_url = ""
        self.lines: queue.Queue[str] = queue.Queue()

    def start(self) -> CloudProcess:
        self._stderr = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cloud.cli", *self.args],
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            start_new_session=True,
        )
        threading.Thread(target=self._pump, daemon=True).start()
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
                return self
        self.stop()
        raise RuntimeError(f"cloud did not get ready:\n{self.log_path.read_text()[-3000:]}")

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)

    def stop(self, grace_s: float = 30.0) -> int | None:
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # anything left in the group (Triton stubs)
        self._stderr.close()
        return proc.returncode

    def __enter__(self) -> CloudProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
