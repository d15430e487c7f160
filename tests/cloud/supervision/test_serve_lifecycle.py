"""`specsplit-cloud serve` stops Triton and the gateway on SIGTERM, leaving nothing behind."""

from __future__ import annotations

import glob
import os
import signal

import pytest

from specsplit.cloud.supervision.process import CloudProcess

pytestmark = pytest.mark.slow


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_stops_cleanly(tiny, tmp_path, sig):
    cloud = CloudProcess("--target", str(tiny.target), log_dir=tmp_path).start()
    try:
        pgid = cloud.proc.pid  # the CLI leads its own group; Triton names its regions after it
        regions = f"/dev/shm/specsplit{pgid}x*"
        assert glob.glob(regions), "Triton's Python backend regions should exist"
        cloud.proc.send_signal(sig)
        assert cloud.proc.wait(60) == 0
        assert not _group_alive(pgid), "a process of the cloud outlived it"
        assert not glob.glob(regions), "shared memory left behind"
    finally:
        cloud.stop()
