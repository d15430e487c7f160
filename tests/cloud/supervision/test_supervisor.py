"""The Triton supervisor and the process plumbing its restarts rely on, without a tritonserver
(tests/test_restarts.py and tests/test_replicas.py restart real ones)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from specsplit.cloud.supervision.supervisor import TritonSupervisor
from specsplit.cloud.supervision.triton import (
    BundledTriton,
    TritonError,
    _group_alive,
    stop_process_group,
)


class _CrashingServer:
    """Exited once; its restarts fail with the given errors, then succeed."""

    url = "127.0.0.1:1"
    stub_lost = False

    def __init__(self, *errors: BaseException):
        self.errors = list(errors)
        self.proc = subprocess.Popen(["true"])
        self.proc.wait()
        self.attempts = 0

    @property
    def exited(self) -> bool:
        return self.proc is not None

    def restart(self):
        self.attempts += 1
        if self.errors:
            raise self.errors.pop(0)
        self.proc = None
        return self


@pytest.mark.parametrize("error", [TritonError("not ready"), OSError(26, "Text file busy")])
def test_the_supervisor_retries_a_restart_that_failed(error):
    server = _CrashingServer(error)

    async def supervise():
        supervisor = TritonSupervisor(server, poll_s=0.01, backoff_s=(0.01,))
        task = asyncio.create_task(supervisor.run())
        deadline = time.monotonic() + 10
        while supervisor.restarts == 0 and not task.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert not task.done() or task.cancelled(), task.exception()
        return supervisor.restarts

    assert asyncio.run(supervise()) == 1
    assert server.attempts == 2


class _StubLostServer:
    """Runs on, but lost its stub; a restart mends it."""

    url = "127.0.0.1:1"
    exited = False

    def __init__(self):
        self.stub_lost = True
        self.attempts = 0

    def restart(self):
        self.attempts += 1
        self.stub_lost = False
        return self


def test_a_server_that_lost_its_stub_is_restarted():
    server = _StubLostServer()

    async def supervise():
        supervisor = TritonSupervisor(server, poll_s=0.01, backoff_s=(0.01,))
        task = asyncio.create_task(supervisor.run())
        deadline = time.monotonic() + 10
        while supervisor.restarts == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # a few more polls: a mended server is left alone
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return supervisor.restarts

    assert asyncio.run(supervise()) == 1
    assert server.attempts == 1


def test_backends_install_over_a_stub_that_still_runs(tmp_path):
    """On a restart the crashed server's stub may still be exiting from the work dir."""
    src = tmp_path / "bundle"
    src.mkdir()
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        (src / name).write_text(name)
    shutil.copy2(shutil.which("sleep"), src / "triton_python_backend_stub")
    bundled = BundledTriton(Path("/"), src, src / "triton_python_backend_stub", src)
    work = tmp_path / "work"
    backends = bundled.prepare_backends(work)
    running = subprocess.Popen([backends / "python" / "triton_python_backend_stub", "30"])
    try:
        assert bundled.prepare_backends(work) == backends  # ETXTBSY when written in place
        assert sorted(p.name for p in (backends / "python").iterdir()) == [
            "libtriton_python.so",
            "triton_python_backend_stub",
            "triton_python_backend_utils.py",
        ]
    finally:
        running.kill()
        running.wait()


def test_stopping_a_group_waits_until_its_orphans_are_gone():
    leader = subprocess.Popen(["bash", "-c", "sleep 30 & exec sleep 30"], start_new_session=True)
    time.sleep(0.2)
    assert _group_alive(leader.pid)
    stop_process_group(leader, grace_s=5.0, signal_group=True)
    assert not _group_alive(leader.pid)
